"""--logs-specs: a torchrun.logs_specs entry point lays out the log files, as in torchrun."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.conftest import TP_RUN, run_launcher

HELLO = 'import os, sys\nprint("out", os.environ["RANK"])\nprint("err", os.environ["RANK"], file=sys.stderr)\n'


def _install_plugin(root: Path) -> None:
    """A distribution on PYTHONPATH whose LogsSpecs puts every rank under 'custom_<n>'."""
    (root / "myspecs.py").write_text(textwrap.dedent("""
        import os
        from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest

        class FlatSpecs(DefaultLogsSpecs):
            def reify(self, envs):
                base = os.path.join(self.root_log_dir, "flat")
                os.makedirs(base, exist_ok=True)
                out = {r: os.path.join(base, f"custom_{r}.out") for r in envs}
                err = {r: os.path.join(base, f"custom_{r}.err") for r in envs}
                files = {r: os.path.join(base, f"custom_{r}.json") for r in envs}
                for r in envs:
                    envs[r]["TORCHELASTIC_ERROR_FILE"] = files[r]
                return LogsDest(out, err, {}, {}, files,
                                os.path.join(base, "f_out"), os.path.join(base, "f_err"))
    """))
    info = root / "myspecs-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myspecs\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[torchrun.logs_specs]\nflat = myspecs:FlatSpecs\n")


def test_logs_specs_plugin_lays_out_files(tmp_path: Path, test_env: dict[str, str]) -> None:
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    _install_plugin(plugin)
    (tmp_path / "hello.py").write_text(HELLO)
    test_env["PYTHONPATH"] = f"{plugin}:{test_env['PYTHONPATH']}"
    logs = tmp_path / "logs"
    res = run_launcher(TP_RUN, ["--nproc-per-node", "2", "--logs-specs", "flat",
                                "--log-dir", str(logs), "hello.py"], test_env, tmp_path)
    assert res.returncode == 0, res.stderr
    for r in (0, 1):
        assert (logs / "flat" / f"custom_{r}.out").read_text() == f"out {r}\n"
        assert (logs / "flat" / f"custom_{r}.err").read_text() == f"err {r}\n"
    assert "out 0" not in res.stdout


def test_unknown_logs_specs_is_one_line_error(tmp_path: Path, test_env: dict[str, str]) -> None:
    (tmp_path / "hello.py").write_text(HELLO)
    res = run_launcher(TP_RUN, ["--logs-specs", "missing", "hello.py"], test_env, tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "tp-run: error: --logs-specs='missing': no entry point of that name in the "
        "'torchrun.logs_specs' group"]
