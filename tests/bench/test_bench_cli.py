"""Argument parsing and the llama-server command and build layout (nothing built)."""
import dataclasses
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest

from cllm.bench import __main__ as bench_main
from cllm.bench import peer
from cllm.bench.cli import load_settings, parse_args, server_settings
from cllm.bench.servers import StartedServer, cllm_command


def test_defaults():
    args = parse_args(["--url", "http://127.0.0.1:8080"])
    assert args.requests == 72 and args.concurrency == [1, 8, 16, 32] and args.max_tokens == 50
    assert args.stream and args.ignore_eos and args.endpoint == "completions"
    assert args.warmup == 4 and args.ctx_size == 8192 and args.parallel == 32
    assert args.out == Path("bench/results") and args.model is None
    load = load_settings(args)
    assert load.stream and load.ignore_eos and load.max_tokens == 50


def test_options():
    args = parse_args(["--peer", "llama-server", "--cllm", "--concurrency", "8", "1", "8",
                       "--no-stream", "--no-ignore-eos", "--endpoint", "chat", "--batch-size",
                       "256", "--threads", "3", "--flash-attn", "on", "--url", "a", "--url", "b"])
    assert args.concurrency == [1, 8] and args.parallel == 8 and args.url == ["a", "b"]
    assert not args.stream and not args.ignore_eos and args.endpoint == "chat"
    s = server_settings(args)
    assert (s.batch_size, s.ubatch_size, s.threads, s.flash_attn) == (256, 256, 3, "on")
    assert server_settings(parse_args(["--url", "u", "--ubatch-size", "64"])).ubatch_size == 64


def test_sampling_defaults_to_greedy_and_what_clients_send():
    args = parse_args(["--url", "u"])
    assert [(s.label, s.fields) for s in args.sampling] == [
        ("greedy", {"temperature": 0.0}), ("t=1,k=0", {"temperature": 1.0, "top_k": 0}),
        ("t=0.7,p=0.95,k=0", {"temperature": 0.7, "top_p": 0.95, "top_k": 0}),
        ("t=1", {"temperature": 1.0})]
    assert load_settings(args).sampling == {"temperature": 0.0}


def test_sampling_specs_send_only_the_fields_they_name():
    args = parse_args(["--url", "u", "--sampling", "t=0.8,minp=0.05", "greedy"])
    assert [s.fields for s in args.sampling] == [{"temperature": 0.8, "min_p": 0.05},
                                                 {"temperature": 0.0}]


def test_each_sampling_spec_is_a_series_of_its_own():
    args = parse_args(["--url", "u", "--sampling", "greedy", "t=1"])
    sent = []
    target = bench_main.Target("cllm", url="u", sampled=lambda fields: sent.append(fields) or 7)
    series = bench_main._sampling_series(target, args.sampling)
    assert [t.name for t in series] == ["cllm@greedy", "cllm@t=1"]
    assert [t.send for t in series] == [7, 7] and sent == [{"temperature": 0.0},
                                                           {"temperature": 1.0}]
    assert bench_main._sampling_series(target, args.sampling[:1]) == [target]


@pytest.mark.parametrize("argv", [[], ["--url", "u", "--concurrency", "0"],
                                  ["--url", "u", "--sampling", "temperature=1"],
                                  ["--url", "u", "--sampling", "t=hot"],
                                  ["--url", "u", "--prompt-tokens", "5", "--prompt-file", "f"],
                                  ["--peer", "vllm"]])
def test_rejected(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_peer_command_matches_cllm_settings():
    s = server_settings(parse_args(["--peer", "llama-server", "--concurrency", "4", "16",
                                    "--ctx-size", "4096", "--threads", "2"]))
    cmd = peer.server_command(Path("/bin/llama-server"), Path("/m.gguf"), 1234, s)
    def flag(name: str) -> str:
        return cmd[cmd.index(name) + 1]

    assert (flag("-np"), flag("-c"), flag("-t"), flag("-b"), flag("-ub")) == (
        "16", "4096", "2", "512", "512")
    assert flag("--port") == "1234" and flag("-m") == "/m.gguf" and flag("-fa") == "auto"
    assert flag("-ngl") == "all"  # cllm's -1
    assert {"--no-repack", "--no-webui"} <= set(cmd)
    # llama-server's own layout, split, whatever cllm's (one pool on a GPU): the peer at its best.
    assert "--kv-unified" not in cmd
    s.kv_unified = True
    assert "--kv-unified" not in peer.server_command(Path("/b"), Path("/m"), 1, s)
    s.peer_kv_unified = True
    assert "--kv-unified" in peer.server_command(Path("/b"), Path("/m"), 1, s)
    best = server_settings(parse_args(["--peer", "llama-server", "--peer-args", "-bs -fa on"]))
    assert peer.server_command(Path("/b"), Path("/m"), 1, best)[-3:] == ["-bs", "-fa", "on"]
    args = parse_args(["--peer", "llama-server", "--kv-unified", "--peer-kv", "split"])
    split_peer = dataclasses.replace(server_settings(args), peer_kv_unified=False)
    assert "--kv-unified" not in peer.server_command(Path("/b"), Path("/m"), 1, split_peer)
    both = parse_args(["--peer", "llama-server", "--peer-kv", "split", "unified", "split"])
    assert both.peer_kv == ["split", "unified"]


def test_cllm_args_reach_cllm_only():
    s = server_settings(parse_args(["--cllm", "--peer", "llama-server",
                                    "--cllm-args", "--stream-interval 4"]))
    assert cllm_command("m", 1, s)[-2:] == ["--stream-interval", "4"]
    assert "--stream-interval" not in peer.server_command(Path("/b"), Path("/m"), 1, s)


def test_build_dir_keyed_by_tree_and_cmake_args(monkeypatch, tmp_path):
    monkeypatch.setenv("CLLM_CACHE_DIR", str(tmp_path))
    cpu = peer.build_dir(tmp_path / "a", [])
    assert cpu.parent == tmp_path and cpu.name.startswith("llama-server-build-")
    assert cpu == peer.build_dir(tmp_path / "a", []) != peer.build_dir(tmp_path / "b", [])
    cuda = peer.build_dir(tmp_path / "a", ["-DGGML_CUDA=on", "-DCMAKE_CUDA_ARCHITECTURES=90"])
    assert cuda.name.startswith("llama-server-build-cuda-")
    assert cuda != peer.build_dir(tmp_path / "a", ["-DGGML_CUDA=on"])


def test_missing_tree_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("CLLM_LLAMA_SOURCE", str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit, match="pip install"):
        peer.source_tree()


def test_ui_stub_mirror(monkeypatch, tmp_path):
    tree = tmp_path / "tree"
    (tree / "tools").mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text("")
    monkeypatch.setenv("CLLM_CACHE_DIR", str(tmp_path / "cache"))
    mirror = peer._source_with_ui_stub(tree)
    assert (mirror / "tools").resolve() == (tree / "tools").resolve()
    assert "configure_file" in (mirror / "scripts" / "ui-assets.cmake").read_text()
    assert peer._source_with_ui_stub(tree) == mirror  # a second call reuses it
    (tree / "scripts").mkdir()
    (tree / "scripts" / "ui-assets.cmake").write_text("")
    assert peer._source_with_ui_stub(tree) == tree


def test_cllm_command_parses_as_cllm_serve():
    from cllm import serve
    s = server_settings(parse_args(["--cllm", "--concurrency", "8", "--batch-size", "256",
                                    "--threads", "2", "--flash-attn", "off", "--kv-unified"]))
    cmd = cllm_command("smollm2-135m-instruct", 4321, s)
    assert cmd[1:3] == ["-m", "cllm.serve"]
    options = serve.parse_args(cmd[3:])
    assert (options["parallel"], options["ctx_size"], options["batch_size"],
            options["ubatch_size"], options["threads"], options["flash_attn"],
            options["port"], options["kv_unified"]) == (8, 8192, 256, 256, 2, "off", 4321, True)


def test_workload_options():
    args = parse_args(["--url", "u"])
    assert (args.workload, args.prefix_tokens, args.turns, args.cache_prompt) == (
        "standard", 1400, 10, None)
    turns = parse_args(["--url", "u", "--workload", "multi-turn", "--turns", "4"])
    assert turns.endpoint == "chat" and turns.turns == 4
    assert load_settings(parse_args(["--url", "u", "--no-cache-prompt"])).cache_prompt is False


@pytest.mark.parametrize("argv", [["--workload", "mixed", "--prompt-tokens", "9"],
                                  ["--workload", "shared-prefix", "--prompt-file", "f"],
                                  ["--workload", "multi-turn", "--endpoint", "completions"],
                                  ["--workload", "multi-turn", "--engine-direct"],
                                  ["--workload", "long"], ["--turns", "0"]])
def test_workload_conflicts_rejected(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--url", "u", *argv])


def test_each_started_peer_records_its_own_kv_layout(monkeypatch, tmp_path):
    started = []

    def start_peer(model, settings, logs, name):
        started.append(settings.peer_kv_unified)
        process = SimpleNamespace(args=[name], poll=lambda: 0)  # as if it had exited: no stop
        return StartedServer(name, f"http://{name}", process, tmp_path)

    monkeypatch.setattr(bench_main, "start_peer", start_peer)
    monkeypatch.setattr(bench_main, "resolve_model", lambda model: Path("/m.gguf"))
    args = parse_args(["--peer", "llama-server", "--peer-kv", "split", "unified"])
    data = {"servers": {}}
    with ExitStack() as stack:
        bench_main._start_targets(args, stack, data)
    assert started == [False, True]
    assert {name: s["kv"] for name, s in data["servers"].items()} == {
        "llama-server-split": "split", "llama-server-unified": "unified"}
    assert "peer_kv_unified" not in bench_main._settings(args)["server"]


def test_a_levels_line_says_where_the_engine_threads_time_went(capsys):
    from cllm.engine.steptimer import StepTimer, summarize
    timer = StepTimer()
    timer.start()
    timer.add_run({"steps": 8, "decode_ms": 4.0, "after_step_ms": 0.0, "wait_ms": 0.25,
                   "sample_ms": 0.5, "held_rows": 2.0}, call_seconds=0.042)
    timer.end(rows=64, forward_steps=8)
    metrics = {"completed": 1, "failed": 0, "resent": 0, "output_throughput": 100.0,
               "ttft_ms": {"p50": 10.0}, "cached_share": None}
    bench_main._print_run({"server": "cllm", "level": "c=64", "metrics": metrics,
                           "engine_steps": summarize(timer.snapshot())})
    err = capsys.readouterr().err
    assert "1 calls, 64.0 rows and 8.0 forward steps a call" in err
    assert ("decode runs, ms a forward step: llama_decode 4.00, after_step 0.00, wait 0.25, "
            "sample 0.50, outside 0.50; 2.0 held rows each") in err
