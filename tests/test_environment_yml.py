"""Offline checks of environment.yml (the conda environment for GPU clusters).

Checks: the YAML parses; every conda dependency is a valid conda MatchSpec (a small, strict
parser below); the pip section plus the conda packages cover every requirement in
pyproject.toml (dependencies and all optional extras); `-e .` installs the project; and the
pinned versions agree with pyproject.toml.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
ENV_FILE = ROOT / "environment.yml"
PYPROJECT = ROOT / "pyproject.toml"

# PyPI distribution name -> conda package name, where the two differ and the conda package
# is what environment.yml installs.
CONDA_EQUIVALENT = {"torch": "pytorch"}


# --------------------------------------------------------------------------------------------
# A strict parser for the subset of conda's MatchSpec grammar that an environment file needs:
#
#   [channel[/subdir]::]name
#   [channel::]name=version[=build]        fuzzy "=" form (=1.2 means 1.2.*)
#   [channel::]name<op>version[,|<op>version...]    op in == != <= >= ~= < >
#   [channel::]name version-spec [build]   space-separated form
#
# This parser is stricter than conda in one respect: each version must start with a digit or
# be "*". A bare word like "b" in "a b c" is therefore not taken as a version. conda would
# accept it, but in an environment file it is always a mistake.
# --------------------------------------------------------------------------------------------

_IDENT = r"[A-Za-z0-9_][A-Za-z0-9_.\-]*"
_CHANNEL = rf"(?P<channel>{_IDENT}(?:/{_IDENT})*)::"
_NAME = rf"(?P<name>{_IDENT})"
_ATOM = r"(?:\*|[0-9](?:[0-9A-Za-z_.+!]|\*)*)"
_OP = r"(?:==|!=|<=|>=|~=|<|>)"
_OP_OR_EQ = rf"(?:{_OP}|=)"
_BUILD = r"[A-Za-z0-9_.+*]+"
_CONSTRAINT = rf"{_OP_OR_EQ}?{_ATOM}"

_MATCHSPEC = re.compile(
    rf"""^(?:{_CHANNEL})?{_NAME}
    (?:
        =(?P<eq_version>{_ATOM})(?:=(?P<eq_build>{_BUILD}))?              # name=1.2[=build]
      | (?P<op_version>{_OP}{_ATOM}(?:[,|]{_CONSTRAINT})*)                # name>=1,<2
      | [ \t]+(?P<sp_version>{_CONSTRAINT}(?:[,|]{_CONSTRAINT})*)         # name 1.2.* [build]
        (?:[ \t]+(?P<sp_build>{_BUILD}))?
    )?$""",
    re.VERBOSE,
)


def parse_matchspec(spec: str) -> dict:
    """Parse a conda MatchSpec string into channel/name/version/build; raise ValueError if invalid."""
    if not isinstance(spec, str):
        raise ValueError(f"MatchSpec must be a string, got {type(spec).__name__}: {spec!r}")
    m = _MATCHSPEC.match(spec.strip())
    if m is None:
        raise ValueError(f"not a valid conda MatchSpec: {spec!r}")
    g = m.groupdict()
    return {
        "channel": g["channel"],
        "name": g["name"].lower(),
        "version": g["eq_version"] or g["op_version"] or g["sp_version"],
        "build": g["eq_build"] or g["sp_build"],
    }


def pep503(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env() -> dict:
    with ENV_FILE.open() as f:
        data = yaml.safe_load(f)
    assert isinstance(data, dict), "environment.yml must be a mapping"
    return data


@pytest.fixture(scope="module")
def conda_specs(env) -> list[str]:
    return [d for d in env["dependencies"] if not isinstance(d, dict)]


@pytest.fixture(scope="module")
def pip_lines(env) -> list[str]:
    sections = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(sections) == 1, "expected exactly one pip: section"
    return [str(x).strip() for x in sections[0]]


@pytest.fixture(scope="module")
def pip_requirements(pip_lines) -> dict[str, Requirement]:
    reqs = {}
    for line in pip_lines:
        if line.startswith("-"):  # options such as "-e ." are not requirements
            continue
        r = Requirement(line)
        reqs[pep503(r.name)] = r
    return reqs


@pytest.fixture(scope="module")
def pyproject_requirements() -> list[Requirement]:
    with PYPROJECT.open("rb") as f:
        project = tomllib.load(f)["project"]
    lines = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        lines.extend(extra)
    return [Requirement(x) for x in lines]


# --------------------------------------------------------------------------------------------
# The parser itself (both directions, so that the validity test below can fail)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("pip", dict(channel=None, name="pip", version=None, build=None)),
        ("python=3.11", dict(channel=None, name="python", version="3.11", build=None)),
        ("conda-forge::pytorch=2.9.*=cuda129*",
         dict(channel="conda-forge", name="pytorch", version="2.9.*", build="cuda129*")),
        ("numpy>=1.20,<2", dict(channel=None, name="numpy", version=">=1.20,<2", build=None)),
        ("numpy==1.26.4", dict(channel=None, name="numpy", version="==1.26.4", build=None)),
        ("python 3.11.*", dict(channel=None, name="python", version="3.11.*", build=None)),
        ("pytorch 2.9.1 cuda129_generic_py311_0",
         dict(channel=None, name="pytorch", version="2.9.1", build="cuda129_generic_py311_0")),
        ("libblas=*=*mkl", dict(channel=None, name="libblas", version="*", build="*mkl")),
        ("conda-forge/linux-64::cuda-version=12.9",
         dict(channel="conda-forge/linux-64", name="cuda-version", version="12.9", build=None)),
    ],
)
def test_matchspec_parser_accepts_valid(spec, expected):
    assert parse_matchspec(spec) == expected


@pytest.mark.parametrize(
    "spec",
    [
        "numpy===>1",
        "a b c",
        "",
        "=1.0",
        "numpy>=",
        "numpy=",
        "numpy=>1",
        "numpy 1.2 build extra",
        "pytorch=2.9=cuda=extra",
        "::numpy",
        "numpy; python_version<'3'",
        "-e .",
        "numpy@1.0",
    ],
)
def test_matchspec_parser_rejects_garbage(spec):
    with pytest.raises(ValueError):
        parse_matchspec(spec)


# --------------------------------------------------------------------------------------------
# environment.yml
# --------------------------------------------------------------------------------------------


def test_top_level_keys(env):
    assert env["name"] == "cp-attn-bench"
    assert set(env["channels"]) == {"pytorch", "nvidia", "conda-forge"}
    # conda-forge must win: the CUDA libraries of conda-forge's pytorch must not come from nvidia.
    assert env["channels"][0] == "conda-forge"
    assert isinstance(env["dependencies"], list)


def test_every_conda_dependency_is_a_matchspec(conda_specs):
    assert conda_specs, "no conda dependencies"
    for spec in conda_specs:
        parse_matchspec(spec)  # raises on failure


def test_conda_core_packages(conda_specs):
    parsed = {parse_matchspec(s)["name"]: parse_matchspec(s) for s in conda_specs}
    assert parsed["python"]["version"] == "3.11"
    assert "pip" in parsed
    torch = parsed["pytorch"]
    assert torch["version"] == torch_pin(), torch
    assert torch["build"] and torch["build"].startswith("cuda"), "pytorch must be pinned to a CUDA build"
    # The pytorch-cuda metapackage exists only on the pytorch channel, which stopped at torch 2.5:
    # combining it with a newer pytorch cannot be solved.
    assert "pytorch-cuda" not in parsed
    # The CUDA version of the pytorch build string must agree with the cuda-version pin.
    cuda = parsed["cuda-version"]["version"]
    assert torch["build"].startswith("cuda" + cuda.replace(".", "")), (torch["build"], cuda)


def test_pip_section_installs_project_editable(pip_lines):
    assert "-e ." in pip_lines


def test_pip_lines_are_valid_requirements(pip_lines):
    for line in pip_lines:
        if line.startswith("-"):
            assert line == "-e .", f"unexpected pip option line {line!r}"
        else:
            Requirement(line)  # raises InvalidRequirement on failure


def test_pyproject_requirements_covered(pyproject_requirements, pip_requirements, conda_specs):
    conda_names = {parse_matchspec(s)["name"] for s in conda_specs}
    assert pyproject_requirements, "pyproject.toml lists no requirements?"
    missing = []
    for req in pyproject_requirements:
        name = pep503(req.name)
        if name in CONDA_EQUIVALENT:
            if CONDA_EQUIVALENT[name] not in conda_names:
                missing.append(f"{req.name} (as conda {CONDA_EQUIVALENT[name]})")
        elif name not in pip_requirements:
            missing.append(req.name)
    assert not missing, f"pyproject requirements missing from environment.yml pip section: {missing}"


def test_tool_packages_present(pip_requirements, conda_specs):
    """Packages the brief asks for but pyproject does not name (flash-attn) must be somewhere."""
    available = set(pip_requirements) | {pep503(parse_matchspec(s)["name"]) for s in conda_specs}
    for name in ["flash-attn", "ring-flash-attn", "deepspeed", "submitit", "pandas", "matplotlib",
                 "pyyaml", "numpy", "jupytext", "nbconvert", "ipykernel", "papermill", "pytest"]:
        assert name in available, name


def test_no_package_both_in_conda_and_pip(pip_requirements, conda_specs):
    # conda runs `pip install -U`: a package in both places would be silently replaced by pip.
    conda_names = {pep503(parse_matchspec(s)["name"]) for s in conda_specs}
    pip_names = set(pip_requirements) | {pep503(k) for k, v in CONDA_EQUIVALENT.items() if v in conda_names}
    assert not (conda_names & pip_names), conda_names & pip_names


def test_pins_agree_with_pyproject(pyproject_requirements, pip_requirements, conda_specs):
    parsed = {parse_matchspec(s)["name"]: parse_matchspec(s) for s in conda_specs}
    for req in pyproject_requirements:
        name = pep503(req.name)
        if name in CONDA_EQUIVALENT:
            version = parsed[CONDA_EQUIVALENT[name]]["version"]
            lowest = Version(version.split(",")[0].lstrip("=<>!~").rstrip(".*"))
            assert req.specifier.contains(lowest, prereleases=True), (req, version)
        elif req.specifier:
            pin = pip_requirements[name]
            # The environment may pin more tightly, but never drop or contradict a pyproject bound.
            assert pin.specifier, f"{req.name}: pyproject says {req.specifier}, environment.yml has no bound"
            for spec in req.specifier:
                if spec.operator in (">=", ">", "=="):
                    assert any(s.operator in (">=", ">", "==") for s in pin.specifier), (req, pin)


def test_python_satisfies_requires_python(env):
    from packaging.specifiers import SpecifierSet

    with PYPROJECT.open("rb") as f:
        requires = tomllib.load(f)["project"]["requires-python"]
    python = next(parse_matchspec(s) for s in env["dependencies"]
                  if isinstance(s, str) and parse_matchspec(s)["name"] == "python")
    assert SpecifierSet(requires).contains(python["version"])


def torch_pin() -> str:
    """The torch version pyproject.toml pins (``torch==X``)."""
    with PYPROJECT.open("rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    (spec,) = req.specifier
    assert spec.operator == "==", f"pyproject.toml must pin one torch version, not {req}"
    return spec.version


def test_one_torch_version_everywhere(conda_specs):
    """pyproject.toml, the Makefile's TORCH and environment.yml's pytorch name the same version."""
    pin = torch_pin()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^TORCH\s*\?=\s*torch=={re.escape(pin)}\s*$", makefile, re.M), \
        f"the Makefile's TORCH must be torch=={pin}"
    parsed = {parse_matchspec(s)["name"]: parse_matchspec(s) for s in conda_specs}
    assert parsed["pytorch"]["version"] == pin
