"""cllm.serve's options: flag over CLLM_ variable over TOML file over default, and bad values
refused before anything loads, from flags and from a real process."""
import importlib.util
import math
import os
import sys
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement  # pytest's own dependency
from server_process import ServerProcess

from cllm import serve
from cllm.app import launch
from cllm.config import EngineConfig, apply_cpu_wait, cpu_wait_while_loading, usable_cores


def test_option_precedence_flag_env_file_default(tmp_path, monkeypatch):
    toml = tmp_path / "cllm.toml"
    toml.write_text("decode-steps = 4\nparallel = 6\nstream-interval = 3\n")
    assert serve.build_config(serve.parse_args([])).engine.decode_steps == EngineConfig().decode_steps
    from_file = serve.build_config(serve.parse_args(["--config", str(toml)]))
    assert from_file.stream_interval == 3
    from_file = from_file.engine
    assert from_file.decode_steps == 4 and from_file.n_parallel == 6
    monkeypatch.setenv("CLLM_DECODE_STEPS", "3")
    assert serve.build_config(serve.parse_args(["--config", str(toml)])).engine.decode_steps == 3
    flagged = serve.parse_args(["--config", str(toml), "--decode-steps", "2"])
    assert serve.build_config(flagged).engine.decode_steps == 2


def test_successor_wait_reaches_the_engine_config_and_defaults_by_device():
    assert serve.build_config(serve.parse_args(["--successor-wait", "0"])).engine.successor_wait == 0
    assert serve.build_config(serve.parse_args([])).engine.successor_wait is None  # auto


def test_retention_rules_reach_the_engine_config():
    engine = serve.build_config(serve.parse_args(["--cache-prompts", "drop",
                                                  "--cache-replies", "keep"])).engine
    assert (engine.cache_prompts, engine.cache_replies) == ("drop", "keep")
    assert serve.build_config(serve.parse_args([])).engine.cache_prompts == "auto"


@pytest.mark.parametrize("argv, reason", [
    (["--parallel", "0"], "n_parallel must be at least 1"),
    (["--flash-attn", "sometimes"], "flash_attn must be auto, on or off"),
    (["--request-timeout", "0"], "request_timeout must be positive"),
    (["--cpu-wait", "yield"], "cpu_wait must be one of auto, spin, sleep"),
    (["--stream-interval", "0"], "stream_interval must be at least 1"),
    (["--cache-replies", "always"], "cache_replies must be one of auto, keep, drop"),
    (["--cache-prompts", "never"], "cache_prompts must be one of auto, keep, drop"),
    (["--successor-wait", "1.5"], "successor_wait must be between 0.0 and 1.0"),
])
def test_bad_values_exit_2_with_the_reason(argv, reason, capsys):
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("cllm: error:") and reason in err


@pytest.mark.parametrize("content", [None, b"this is not a GGUF file\n"])
def test_bad_model_path_exits_with_one_line(tmp_path, content):
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    srv = ServerProcess("--model", str(path)).spawn()
    try:
        rc = srv.wait(timeout=60)
    finally:
        srv.kill()
    assert rc == 2  # a usage error, before anything loads
    err = srv.stderr.strip()
    assert "Traceback" not in srv.log
    assert len(err.splitlines()) == 1, err
    assert str(path) in err and "error" in err.lower()


def test_config_file_is_read_with_tomli_before_python_3_11(tmp_path, monkeypatch):
    """tomllib is new in 3.11; requires-python says 3.10, where tomli (its origin, the same API)
    stands in: a dependency there only."""
    # The checkout's pyproject.toml: the package may be installed elsewhere (site-packages).
    pyproject = serve.tomllib.loads((Path(__file__).parent.parent / "pyproject.toml")
                                    .read_text())
    (tomli,) = [Requirement(r) for r in pyproject["project"]["dependencies"]
                if Requirement(r).name == "tomli"]
    assert tomli.marker.evaluate({"python_version": "3.10"})
    assert not tomli.marker.evaluate({"python_version": "3.11"})
    monkeypatch.setitem(sys.modules, "tomllib", None)  # as on 3.10: import tomllib fails
    monkeypatch.setitem(sys.modules, "tomli", serve.tomllib)
    spec = importlib.util.spec_from_file_location("serve_on_310", serve.__file__)
    serve_on_310 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_on_310)
    toml = tmp_path / "cllm.toml"
    toml.write_text("parallel = 6\n")
    assert serve_on_310.parse_args(["--config", str(toml)])["parallel"] == 6


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("CLLM_API_KEY", "from-env")
    assert serve.build_config(serve.parse_args([])).api_key == "from-env"


def test_api_key_from_a_file_stays_out_of_the_process_list(tmp_path):
    key = "file-key-0123456789"
    path = tmp_path / "key"
    path.write_text(key + "\n")
    with ServerProcess("--api-key-file", str(path)) as srv:
        cmdline = Path(f"/proc/{srv.proc.pid}/cmdline").read_bytes()
        assert key.encode() not in cmdline
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200


def test_a_key_file_names_users_with_their_weights_and_priorities(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# the family\nk-alice name=alice weight=2\n\n"
                    "k-agents name=agents priority=5 max_requests=8 tokens_per_minute=9000\n"
                    "k-plain\n")
    config = serve.build_config(serve.parse_args(["--api-key-file", str(path)]))
    assert config.api_key is None
    assert [(k.key, k.name, k.weight, k.priority, k.max_requests, k.tokens_per_minute)
            for k in config.keys()] == [("k-alice", "alice", 2.0, 0, None, None),
                                        ("k-agents", "agents", 1.0, 5, 8, 9000),
                                        ("k-plain", "", 1.0, 0, None, None)]


@pytest.mark.parametrize("line, reason", [
    ("k colour=red", "'colour=red' is not one of name=, weight=, priority=, max_requests="),
    ("k name=a name=b", "'name=b' is not"), ("k weight=heavy", "weight takes a number"),
    ("k priority=1.5", "priority takes an integer"), ("k weight=0", "the weight must be above 0"),
    ("k max_requests=0", "max_requests must be at least 1"),
    ("k tokens_per_minute=lots", "tokens_per_minute takes an integer"),
])
def test_bad_key_file_lines_exit_2_naming_the_line(tmp_path, capsys, line, reason):
    path = tmp_path / "keys"
    path.write_text("k0\n" + line + "\n")
    assert serve.main(["--api-key-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and reason in err


@pytest.mark.parametrize("argv, reason", [
    (["--api-key-file", "/nonexistent/key"], "cannot read the API key file"),
    (["--api-key", "k", "--api-key-file", "/dev/null"], "not both"),
    (["--api-key-file", "/dev/null"], "is empty"),
])
def test_bad_api_key_files_exit_2(argv, reason, capsys):
    assert serve.main(argv) == 2
    assert reason in capsys.readouterr().err


@pytest.fixture
def no_wait_policy(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)


def test_cpu_threads_spin_only_briefly_when_they_take_every_core(no_wait_policy):
    assert apply_cpu_wait("auto", 0).startswith("spin 3000")
    assert os.environ["GOMP_SPINCOUNT"] == "3000" and "OMP_WAIT_POLICY" not in os.environ
    os.environ.pop("GOMP_SPINCOUNT")
    assert apply_cpu_wait("auto", usable_cores()).startswith("spin 3000")
    os.environ.pop("GOMP_SPINCOUNT")
    if usable_cores() > 1:  # a core to spare: spinning costs nobody else
        assert apply_cpu_wait("auto", usable_cores() - 1) == "spin"
        assert "GOMP_SPINCOUNT" not in os.environ
    assert apply_cpu_wait("sleep", 0) == "sleep" and os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    os.environ.pop("OMP_WAIT_POLICY")
    assert apply_cpu_wait("spin", 0) == "spin" and "OMP_WAIT_POLICY" not in os.environ


def test_a_wait_policy_in_the_environment_wins(no_wait_policy, monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    assert apply_cpu_wait("sleep", 0) == "environment"
    assert "OMP_WAIT_POLICY" not in os.environ


def test_a_wait_policy_applied_while_loading_leaves_the_environment_as_it_was(no_wait_policy,
                                                                             monkeypatch):
    with cpu_wait_while_loading("auto", 0) as policy:
        assert policy.startswith("spin 3000") and os.environ["GOMP_SPINCOUNT"] == "3000"
    assert "GOMP_SPINCOUNT" not in os.environ  # programs started later keep their defaults
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with cpu_wait_while_loading("sleep", 0) as policy:
        assert policy == "environment"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_every_option_sits_in_one_help_group(capsys):
    grouped = [name for names in serve.GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(serve.OPTIONS)
    with pytest.raises(SystemExit):
        serve.parse_args(["--help"])
    shown = capsys.readouterr().out
    assert all(f"\n{title}:\n" in shown for title in serve.GROUPS)


def test_the_example_config_sets_every_option_when_uncommented(tmp_path):
    """docs/cllm.example.toml, each `# key = value` line uncommented: every option, each value
    of the option's type."""
    example = Path(__file__).resolve().parent.parent / "docs" / "cllm.example.toml"
    settings = [line[2:].split("  #")[0] for line in example.read_text().splitlines()
                if line.startswith("# ") and " = " in line and line[2:3].islower()]
    config = tmp_path / "cllm.toml"
    config.write_text("\n".join(settings) + "\n")
    options = serve.parse_args(["--config", str(config)])
    assert sorted(line.split(" = ")[0] for line in settings) == sorted(serve.OPTIONS)
    assert options["port"] == 8080 and options["model"] == ("smollm2-135m-instruct",)
    assert options["kv_unified"] is False and options["gpus_per_replica"] == 1.0


def test_the_configuration_page_lists_every_option():
    page = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    assert all(f"`--{name.replace('_', '-')}" in page for name in serve.OPTIONS)


def test_several_models_and_their_policy_reach_the_config(tmp_path):
    config = serve.build_config(serve.parse_args([
        "--model", "smollm2-135m-instruct", "--model", "gemma=gemma3-270m",
        "--keep-alive", "5m", "--models-max", "1", "--pin", "gemma"]))
    assert config.models == ("smollm2-135m-instruct", "gemma=gemma3-270m")
    assert (config.keep_alive, config.models_max, config.pinned) == (300.0, 1, ("gemma",))
    sources = launch.model_sources(config)
    assert [s.name for s in sources] == ["smollm2-135m-instruct", "gemma"]
    assert sources[1].argument == "gemma3-270m" and sources[1].path.endswith(".gguf")
    assert config.keep_alive_for(2) == 300.0


def test_keep_alive_defaults_to_never_with_one_model_and_five_minutes_with_several():
    config = serve.build_config(serve.parse_args([]))
    assert config.keep_alive_for(1) == math.inf and config.keep_alive_for(2) == 300.0
    for given, seconds in [("0", 0.0), ("-1", math.inf), ("30s", 30.0), ("1h", 3600.0),
                           ("500ms", 0.5), ("90", 90.0)]:
        config = serve.build_config(serve.parse_args(["--keep-alive", given]))
        assert config.keep_alive_for(2) == seconds


def test_models_dir_serves_every_gguf_file_in_it(tmp_path, model_path, gemma_path):
    for path in (model_path, gemma_path):
        (tmp_path / Path(path).name).symlink_to(path)
    (tmp_path / "notes.txt").write_text("not a model")
    config = serve.build_config(serve.parse_args(["--models-dir", str(tmp_path)]))
    names = [s.name for s in launch.model_sources(config)]
    assert names == sorted([Path(gemma_path).name, Path(model_path).name])


@pytest.mark.parametrize("argv, reason", [
    (["--model", "smollm2-135m-instruct", "--pin", "gemma"], "--pin names no served model"),
    (["--model", "a=smollm2-135m-instruct", "--model", "a=gemma3-270m"], "share a name"),
    (["--model", "smollm2-135m-instruct", "--model", "gemma3-270m", "--served-model-name", "x"],
     "--served-model-name names the only model"),
    (["--models-max", "-1"], "models_max must be 0"),
    (["--models-dir", "/nonexistent/folder"], "is not a folder"),
])
def test_bad_model_sets_exit_2_with_the_reason(argv, reason, capsys):
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("cllm: error:") and reason in err


def test_a_keep_alive_that_is_no_duration_is_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        serve.parse_args(["--keep-alive", "soon"])
    assert exited.value.code == 2 and "--keep-alive" in capsys.readouterr().err
