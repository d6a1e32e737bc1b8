"""cllm.serve's options: flag over CLLM_ variable over TOML file over default, and bad values
refused before anything loads."""
import pytest

from cllm import serve
from cllm.config import ServerConfig


def test_option_precedence_flag_env_file_default(tmp_path, monkeypatch):
    toml = tmp_path / "cllm.toml"
    toml.write_text("gil-switch-ms = 2.0\nparallel = 4\n")
    assert serve.build_config(serve.parse_args([])).gil_switch_ms == ServerConfig().gil_switch_ms
    from_file = serve.build_config(serve.parse_args(["--config", str(toml)]))
    assert from_file.gil_switch_ms == 2.0 and from_file.engine.n_parallel == 4
    monkeypatch.setenv("CLLM_GIL_SWITCH_MS", "1.5")
    assert serve.build_config(serve.parse_args(["--config", str(toml)])).gil_switch_ms == 1.5
    flagged = serve.parse_args(["--config", str(toml), "--gil-switch-ms", "0.25"])
    assert serve.build_config(flagged).gil_switch_ms == 0.25


@pytest.mark.parametrize("argv", [["--gil-switch-ms", "0"], ["--parallel", "0"],
                                  ["--flash-attn", "sometimes"]])
def test_bad_values_exit_2_with_the_reason(argv, capsys):
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("cllm: error:") and argv[0].lstrip("-").replace("-", "_")[:8] in err
