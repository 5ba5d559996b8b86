"""The `mmspec` command line: help, selfcheck, clear errors."""

import posixpath
import subprocess
import sys
import textwrap
import types

import pytest

from mmspec.cli import main
from mmspec.lazy import lazy_exports


def test_help_lists_commands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "selfcheck" in out and "bench" in out and "train" in out


def test_selfcheck_passes_on_this_machine(capsys):
    assert main(["selfcheck"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out
    assert "[  ok] greedy speculative == greedy vanilla" in out


def test_a_command_run_in_a_process_group_leaves_it(tmp_path, capsys):
    """A command launched in several processes destroys its process group before the interpreter exits, whether it
    ends well or with an error (a gloo group left to the exit aborted a finished two-process run in a CI run); here
    a one-process gloo group."""
    import torch.distributed as dist

    for n, (argv, code) in enumerate([(["selfcheck"], 0), (["generate", "--out", str(tmp_path / "out"),
                                                             "--seed", "-1"], 2)]):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'rendezvous{n}'}", rank=0, world_size=1)
        try:
            assert main(argv) == code
            assert not dist.is_initialized()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def test_unknown_command_is_an_argparse_error():
    proc = subprocess.run([sys.executable, "-m", "mmspec", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_top_level_help_imports_no_torch_and_packages_import_their_pipelines_on_first_use():
    """`mmspec --help` reads the commands without importing them (no torch: 0.2-0.3 s here, was 3.2-3.5 s), and a
    family package's exports are imported when first used (`mmspec.lazy`), so a family record does not bring in
    every pipeline of its package."""
    script = (
        "import sys\n"
        "from mmspec.cli import main\n"
        "assert main([]) == 0  # the top-level help (--help itself exits)\n"
        "assert 'torch' not in sys.modules, 'mmspec --help imported torch'\n"
        "import image_ar.transformers_ar, continuous.mar, image_ar.var, image_ar.llamagen\n"
        "assert 'diffusers' not in sys.modules, 'a family package imported its pipelines'\n"
        "assert 'VARPipeline' in dir(image_ar.var) and 'VARPipeline' not in vars(image_ar.var)\n"
        "from image_ar.transformers_ar import check_image_generator\n"
        "from image_ar.transformers_ar.support import check_image_generator as defined\n"
        "assert check_image_generator is defined and 'check_image_generator' in vars(image_ar.transformers_ar)\n"
        "print('checked')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.endswith("checked\n"), proc.stderr[-2000:]


def test_generate_tells_bad_settings_before_torch_loads(tmp_path):
    """`mmspec generate` checks what needs no model (counts, seeds, sampling, captions) before torch or any family
    loads (0.13 s here; torch alone is 1.3-1.8 s), and leaves no --out folder behind."""
    bad_text = tmp_path / "captions.txt"
    bad_text.write_bytes(b"\xff\xfe not utf-8\n")
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import sys
        from mmspec.cli import main
        cases = [["--num-images", "1000000000"], ["--seed", "-1"], ["--temperature", "-2"], ["--top-k", "-1"],
                 ["--guidance-scale", "1e9"], ["--prompt", ""], ["--prompts", {str(bad_text)!r}], ["--max-batch", "0"],
                 ["--threads", "0"]]
        for case in cases:
            assert main(["generate", "--out", {str(out)!r}, *case]) == 2, case
            assert "torch" not in sys.modules, f"{{case}} imported torch"
        print("checked")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.endswith("checked\n"), proc.stderr[-2000:]
    assert proc.stderr.count("mmspec: error:") == 9 and "Traceback" not in proc.stderr
    assert not out.exists()


def test_lazy_exports_import_on_first_use_rename_and_refuse_unknown_names(monkeypatch):
    package = types.ModuleType("lazy_probe")
    monkeypatch.setitem(sys.modules, "lazy_probe", package)
    package.__getattr__, package.__dir__, names = lazy_exports("lazy_probe", {"join_paths": ("posixpath", "join"),
                                                                              "dedent": "textwrap"})
    assert names == ["dedent", "join_paths"]  # its __all__
    assert package.join_paths is posixpath.join and package.dedent is textwrap.dedent
    assert "join_paths" in vars(package) and {"dedent", "join_paths"} <= set(package.__dir__())
    with pytest.raises(AttributeError, match="no attribute 'wrap'"):
        getattr(package, "wrap")  # noqa: B009  (the lookup under test)
