"""Model names resolve in any program that imports timm, with no ``import timm_layerscale``."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from helpers import ROOT

pytestmark = [pytest.mark.compat, pytest.mark.full]  # make test leaves this file to make test-full


HOOK = "_timm_layerscale_autoload"
MODEL = "cait_xxs24_224_ls"
STARTUP_FILES = {
    "timm_layerscale.pth": f"import {HOOK}; {HOOK}.install()\n",
    "timm_layerscale.start": f"{HOOK}:install\n",
}
OFF_VALUES = ["0", "false", "no", "off", " OFF "]


class Env:
    """A scratch virtual environment; its interpreters run in a scratch folder, never the repository."""

    def __init__(self, root: Path, home: Path):
        self.root = root
        self.python = root / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
        self.home = home
        self.site_packages = Path(self.eval("import sysconfig; print(sysconfig.get_paths()['purelib'])"))

    def start(self, *args: str, env: dict | None = None) -> "Run":
        environ = _clean_environ(self.home)
        environ.update(env or {})
        return Run([str(self.python), *args], cwd=self.home, env=environ)

    def run(self, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return self.start(*args, env=env).result()

    def eval(self, code: str, *flags: str, env: dict | None = None) -> str:
        return self.run(*flags, "-c", code, env=env).stdout.strip()


class Run:
    """A started interpreter; ``result()`` waits for it and fails the test if it failed."""

    def __init__(self, argv: list, **kwargs):
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)

    def result(self) -> subprocess.CompletedProcess:
        try:
            out, err = self.proc.communicate(timeout=600)
        finally:
            self.kill()
        if self.proc.returncode != 0:
            pytest.fail(f"{self.argv[1:]} exited {self.proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}")
        return subprocess.CompletedProcess(self.argv, self.proc.returncode, out, err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_KEPT = ("PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED")


def _clean_environ(home: Path) -> dict:
    """This environment without what changes how Python finds modules, or the hook's switch."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if k in _KEPT or not k.startswith(("PYTHON", "TIMM_LAYERSCALE_", "VIRTUAL_ENV"))
    }
    environ.update(HF_HUB_OFFLINE="1", HF_HOME=str(home / "hf"), OMP_NUM_THREADS="1")
    return environ


def _copy_project(dst: Path) -> Path:
    """Copy what a build reads: the top-level files and the package."""
    dst.mkdir()
    for item in ROOT.iterdir():
        if item.is_file() and not item.name.startswith("."):
            shutil.copy2(item, dst / item.name)
    shutil.copytree(ROOT / "timm_layerscale", dst / "timm_layerscale", ignore=shutil.ignore_patterns("__pycache__"))
    if not (dst / "README.md").exists():
        (dst / "README.md").write_text("timm-layerscale\n")
    return dst


def _build_args() -> list:
    """Build offline with this interpreter's setuptools when it meets [build-system] (as it
    does after ``make``); otherwise let pip set up an isolated build from the package index."""
    usable = False
    if sys.version_info >= (3, 11):  # tomllib reads [build-system]
        try:
            from importlib.metadata import version

            import tomllib
            from packaging.requirements import Requirement

            requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
            usable = all(Requirement(r).specifier.contains(version(Requirement(r).name)) for r in requires)
        except Exception:
            pass  # stays False: pip sets up the build
    return ["--no-build-isolation", "--no-index"] if usable else []


def _pip(python, *args: str, home: Path) -> None:
    proc = subprocess.run(
        [str(python), "-m", "pip", *args, "-q", "--disable-pip-version-check"],
        cwd=home,
        env=_clean_environ(home),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _scratch_env(root: Path, home: Path) -> Env:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    env = Env(root, home)
    paths = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (env.site_packages / "_deps.pth").write_text("".join(f"{p}\n" for p in paths))
    return env


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("autoload")


@pytest.fixture(scope="module")
def project(home) -> Path:
    return _copy_project(home / "project")


@pytest.fixture(scope="module")
def wheel(project, home) -> Path:
    dist = home / "dist"
    _pip(sys.executable, "wheel", "--no-deps", *_build_args(), "-w", str(dist), str(project), home=home)
    (found,) = dist.glob("timm_layerscale-*.whl")
    return found


@pytest.fixture(scope="module")
def wheel_env(wheel, home) -> Env:
    env = _scratch_env(home / "wheel-venv", home)
    _pip(env.python, "install", "--no-deps", "--no-index", str(wheel), home=home)
    return env


@pytest.fixture(scope="module")
def editable_env(project, home) -> Env:
    env = _scratch_env(home / "editable-venv", home)
    _pip(env.python, "install", "--no-deps", *_build_args(), "-e", str(project), home=home)
    return env


@pytest.fixture(scope="module", params=["wheel", "editable"])
def installed(request) -> Env:
    return request.getfixturevalue(f"{request.param}_env")


# What timm's validate.py, inference.py and benchmark.py do with a model name, after the
# kind of availability probe other libraries run first. It never imports timm_layerscale.
VALIDATE_LIKE = textwrap.dedent(
    """
    import importlib.util, json, sys
    assert importlib.util.find_spec("timm") is not None
    import timm, timm.data, torch

    name, weights, hub_dir, inputs, outputs = sys.argv[1:]
    torch.set_num_threads(1)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=weights)).eval()
    from_dir = timm.create_model("local-dir:" + hub_dir, pretrained=True).eval()
    x = torch.load(inputs)
    with torch.no_grad():
        torch.save({"file": model(x), "local-dir": from_dir(x)}, outputs)
    print(json.dumps({
        "names": timm.list_models("*_ls"),
        "module_file": sys.modules[type(model).__module__].__file__,
        "data_config": timm.data.resolve_data_config({}, model=model),
        "still_watching": any("autoload" in repr(f) for f in sys.meta_path),
        "loader_patched": "exec_module" in vars(timm.__loader__),
    }))
    """
)

SWITCHED_OFF = textwrap.dedent(
    f"""
    import json, sys, timm
    try:
        timm.create_model("{MODEL}")
        error = None
    except RuntimeError as exc:
        error = str(exc)
    print(json.dumps({{"error": error, "loaded": "timm_layerscale" in sys.modules, "names": timm.list_models("*_ls")}}))
    """
)

BROKEN_PLUGIN = textwrap.dedent(
    """
    from timm.models import register_model

    @register_model
    def half_registered_ls(pretrained=False, **kwargs):
        raise AssertionError

    raise RuntimeError("registration broke halfway")
    """
)

WITH_BROKEN_PLUGIN = textwrap.dedent(
    """
    import json, sys
    import timm
    state = {
        "half": timm.is_model("half_registered_ls"),
        "module_listed": "timm_layerscale" in timm.list_modules(),
        "loaded": "timm_layerscale" in sys.modules,
        "resnet": timm.is_model("resnet18"),
    }
    try:
        import timm_layerscale
    except RuntimeError as exc:
        state["explicit"] = str(exc)
    print(json.dumps(state))
    """
)


@pytest.fixture(scope="module")
def reference(home):
    """Weights, a Hub-style folder, an input, and the output of the explicitly imported model."""
    import timm
    import torch

    import timm_layerscale  # noqa: F401  (the explicit import that the hook makes unnecessary)

    out = home / "reference"
    out.mkdir()
    torch.manual_seed(0)
    model = timm.create_model(MODEL)
    with torch.no_grad():
        for p in model.parameters():  # every parameter random, LayerScale gammas included
            p.normal_(0.0, 0.02)
    torch.save(model.state_dict(), out / "weights.pth")
    timm.models.save_for_hf(model, out / "hub")
    x = torch.randn(2, 3, 224, 224)
    torch.save(x, out / "input.pth")

    loaded = timm.create_model(MODEL, pretrained=True, pretrained_cfg_overlay=dict(file=str(out / "weights.pth")))
    loaded.eval()
    for (key, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            y = loaded(x)
    finally:
        torch.set_num_threads(threads)
    config = json.loads(json.dumps(timm.data.resolve_data_config({}, model=loaded)))
    return {"dir": out, "output": y, "data_config": config}


@pytest.fixture(scope="module")
def timm_runs(wheel_env, home, request):
    """Every run that imports torch and timm, started together: they dominate this file's time."""
    broken = home / "broken" / "timm_layerscale"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(BROKEN_PLUGIN)
    runs = {}
    try:
        runs["switched-off"] = wheel_env.start("-c", SWITCHED_OFF, env={"TIMM_LAYERSCALE_AUTOLOAD": "0"})
        runs["broken"] = wheel_env.start(
            "-W", "always", "-c", WITH_BROKEN_PLUGIN, env={"PYTHONPATH": str(broken.parent)}
        )
        editable_env = request.getfixturevalue("editable_env")
        ref = request.getfixturevalue("reference")["dir"]
        script = home / "validate_like.py"
        script.write_text(VALIDATE_LIKE)
        for kind, env in (("wheel", wheel_env), ("editable", editable_env)):
            args = [str(ref / "weights.pth"), str(ref / "hub"), str(ref / "input.pth"), str(home / f"{kind}-out.pth")]
            runs[kind] = env.start(str(script), MODEL, *args)
        return {name: run.result() for name, run in runs.items()}
    finally:
        for run in runs.values():
            run.kill()


STARTUP_STATE = (
    "import json, sys; "
    f"print(json.dumps({{m: m in sys.modules for m in ('torch', 'timm', 'timm_layerscale', '{HOOK}')}}"
    f" | {{'watching': any(getattr(f, '__module__', '') == '{HOOK}' for f in sys.meta_path)}}))"
)


def test_wheel_ships_startup_files_at_its_root_and_the_package_data(wheel):
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        for name, text in STARTUP_FILES.items():
            assert zf.read(name).decode() == text
        names = set(zf.namelist())
    assert f"{HOOK}.py" in names and {"timm_layerscale/hub/card_template.md", "timm_layerscale/py.typed"} <= names
    assert not any("__pycache__" in n or n.startswith(("tests/", "convert/", "benchmarks/")) for n in names)


def test_startup_files_installed_and_entry_point_resolves(installed):
    for name, text in STARTUP_FILES.items():
        assert (installed.site_packages / name).read_text() == text
    # What a PEP 829 interpreter does with the .start line; a second call changes nothing.
    entry = STARTUP_FILES["timm_layerscale.start"].strip()
    code = (
        f"import pkgutil, sys; sys.meta_path[:] = [f for f in sys.meta_path if f.__module__ != '{HOOK}']; "
        f"install = pkgutil.resolve_name('{entry}'); install(); install(); "
        f"print(sum(f.__module__ == '{HOOK}' for f in sys.meta_path), 'torch' in sys.modules)"
    )
    assert installed.eval(code) == "0 False"  # the .pth file has installed it once already
    code = code.replace("install(); install();", f"sys.modules['{HOOK}']._installed = False; install(); install();")
    assert installed.eval(code) == "1 False"


@pytest.mark.parametrize("flags", [(), ("-I",)], ids=["default", "isolated"])
def test_startup_imports_neither_torch_nor_timm(installed, flags):
    state = json.loads(installed.eval(STARTUP_STATE, *flags))
    assert state == {"torch": False, "timm": False, "timm_layerscale": False, HOOK: True, "watching": True}


@pytest.mark.parametrize("value", OFF_VALUES)
def test_switch_keeps_hook_out_of_startup(wheel_env, value):
    state = json.loads(wheel_env.eval(STARTUP_STATE, env={"TIMM_LAYERSCALE_AUTOLOAD": value}))
    assert state["watching"] is False


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_validate_like_run_without_import(kind, timm_runs, reference, project, home, request):
    """timm.create_model by name, with a weights file and from a Hub-style folder."""
    import torch

    assert "timm_layerscale" not in VALIDATE_LIKE
    report = json.loads(timm_runs[kind].stdout)
    assert MODEL in report["names"]
    assert {"cait_s24_224_ls", "cait_m48_448_ls"} <= set(report["names"])
    where = project if kind == "editable" else request.getfixturevalue(f"{kind}_env").site_packages
    assert Path(report["module_file"]).resolve().is_relative_to(where.resolve())
    assert report["data_config"] == reference["data_config"]
    assert report["still_watching"] is False and report["loader_patched"] is False
    got = torch.load(home / f"{kind}-out.pth")
    assert torch.equal(got["file"], reference["output"])
    assert torch.equal(got["local-dir"], reference["output"])


def test_switch_off_gives_unknown_model(timm_runs):
    state = json.loads(timm_runs["switched-off"].stdout)
    assert "Unknown model" in state["error"]
    assert state["loaded"] is False and state["names"] == []


def test_failing_registration_warns_once_and_leaves_timm_alone(timm_runs):
    proc = timm_runs["broken"]
    assert json.loads(proc.stdout) == {
        "half": False,
        "module_listed": False,
        "loaded": False,
        "resnet": True,
        "explicit": "registration broke halfway",
    }
    warning = "timm-layerscale models are not registered with timm (RuntimeError: registration broke halfway)"
    assert proc.stderr.count(warning) == 1, proc.stderr
    assert "RuntimeWarning" in proc.stderr
