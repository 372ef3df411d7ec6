"""The docs cannot drift from the code: every code block of README.md and docs/*.md is checked here.

- Python blocks parse; every name reached from an ``ampkit`` import resolves; a Trainer or Callback subclass
  defines only hooks that exist and uses only attributes the Trainer has. A block right after the line
  ``<!-- doc-test: run -->`` is run, in a temporary directory.
- Bash blocks: each command is one this project or its documented tools provide. ``ampkit ...`` (also through
  ``python -m`` or ``torchrun``) is parsed by the CLI's own parser and its config loaded with its overrides,
  so a config name, a key or a value that is not valid fails here; scripts and their ``--flags`` exist.
- YAML blocks naming a ``trainer_class`` load against that Trainer's schema.
- Prose: an inline dotted config key (``precision.loss_scale``) must be a key of the schema.
- The reference: every public name (each package's ``__all__``) has a docstring and is rendered by one
  ``::: name`` directive of docs/api/; the hooks page shows the Trainer's own step diagram and every hook;
  the shared-state page lists every field of the state objects.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import re
import shlex
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
from omegaconf import OmegaConf

import ampkit
from ampkit import cli
from ampkit.config import Config, build_config, check_values, import_object, load_config
from ampkit.trainer import HOOKS, BackwardState, Callback, LoopState, LossState, OptimizerState, Trainer

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.glob("*.md")])
RUN_MARKER = "<!-- doc-test: run -->"
# Words the docs write where a reader puts their own: the command around them is still parsed.
PLACEHOLDERS = {"N": "2", "K": "0", "HOST:PORT": "127.0.0.1:29500", "RUN": "run-1"}
PLACEHOLDER_FILES = {"my.yaml", "train.py", "FILE"}
# Commands other than the project's own that the docs may tell a reader to run.
TOOLS = {"tensorboard", "mkdocs", "pip"}


@dataclasses.dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str
    run: bool

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.lang})"


def code_blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page."""
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        indent, lang, start = fence.group(1), fence.group(2), i
        i += 1
        body = []
        while not re.match(rf"^{indent}```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        run = start > 0 and lines[start - 1].strip() == RUN_MARKER
        blocks.append(Block(page, start + 1, lang, textwrap.dedent("\n".join(body)) + "\n", run))
        i += 1
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in code_blocks(page)]


def blocks_of(*langs: str) -> list[Block]:
    return [b for b in ALL_BLOCKS if b.lang in langs]


def test_the_pages_have_code_to_check():
    langs = {b.lang for b in ALL_BLOCKS}
    assert {"python", "bash", "yaml"} <= langs, langs
    assert all(b.lang in {"python", "bash", "yaml", "text"} for b in ALL_BLOCKS), [
        str(b) for b in ALL_BLOCKS if b.lang not in {"python", "bash", "yaml", "text"}
    ]
    assert any(b.run for b in ALL_BLOCKS), f"no block is marked {RUN_MARKER}"


# ----------------------------------------------------------------------------------------------- Python


def _trainer_attributes() -> set[str]:
    """What ``self.X`` may name in a Trainer subclass: the class's attributes and what ``__init__`` sets."""
    source = inspect.getsource(importlib.import_module("ampkit.trainer.trainer"))
    assigned = set(re.findall(r"\bself\.([a-zA-Z]\w*)(?:\s*:[^=\n]+)?\s*=[^=]", source))
    return assigned | {name for name in dir(Trainer) if not name.startswith("_")}


TRAINER_ATTRIBUTES = _trainer_attributes()


class _Resolver(ast.NodeVisitor):
    """Collects the problems of one Python block: unresolvable ampkit names, unknown hooks and attributes."""

    def __init__(self) -> None:
        self.bound: dict[str, object] = {}
        self.problems: list[str] = []

    def _import(self, module: str) -> ModuleType | None:
        module = re.sub(r"^apex\b", "ampkit.compat", module)  # the shim serves apex.* from ampkit.compat
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            self.problems.append(f"cannot import {module}: {exc}")
            return None

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] in {"ampkit", "apex"}:
                module = self._import(alias.name)
                if module is not None:
                    root = alias.asname or alias.name.split(".")[0]
                    self.bound[root] = module if alias.asname else self._import(root)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if (node.module or "").split(".")[0] not in {"ampkit", "apex"}:
            return
        module = self._import(node.module)
        for alias in node.names if module is not None else []:
            if hasattr(module, alias.name):
                self.bound[alias.asname or alias.name] = getattr(module, alias.name)
            else:
                sub = self._import(f"{node.module}.{alias.name}")
                if sub is not None:
                    self.bound[alias.asname or alias.name] = sub

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain, base = [], node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in self.bound:
            obj, path = self.bound[base.id], base.id
            for attr in reversed(chain):
                path += f".{attr}"
                if not hasattr(obj, attr):
                    self.problems.append(f"{path} does not exist")
                    break
                obj = getattr(obj, attr)
            return  # the whole chain is checked; do not visit its inner links again
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = [self._value(b) for b in node.bases]
        is_trainer = any(isinstance(b, type) and issubclass(b, Trainer) for b in bases)
        is_callback = any(isinstance(b, type) and issubclass(b, Callback) for b in bases)
        own = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        own |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        for item in node.body:
            if not isinstance(item, ast.FunctionDef):
                continue
            if (is_trainer or is_callback) and item.name.startswith("on_") and item.name not in HOOKS:
                self.problems.append(f"{node.name}.{item.name} is no hook (hooks: ampkit.trainer.HOOKS)")
            if is_trainer and item.args.args:
                self._check_attributes(item, item.args.args[0].arg, own, node.name)
            if is_callback and len(item.args.args) > 1 and item.name in HOOKS:
                self._check_attributes(item, item.args.args[1].arg, set(), "trainer")
        self.generic_visit(node)

    def _check_attributes(self, fn: ast.FunctionDef, name: str, own: set[str], owner: str) -> None:
        for sub in ast.walk(fn):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == name:
                if sub.attr not in TRAINER_ATTRIBUTES and sub.attr not in own and not sub.attr.startswith("_"):
                    self.problems.append(f"{owner}: {name}.{sub.attr} is no attribute of ampkit.Trainer")

    def _value(self, node: ast.expr) -> object:
        if isinstance(node, ast.Name):
            return self.bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._value(node.value)
            return getattr(base, node.attr, None) if base is not None else None
        return None


@pytest.mark.parametrize("block", blocks_of("python"), ids=str)
def test_python_block_parses_and_its_ampkit_names_resolve(block: Block):
    tree = ast.parse(block.text, filename=str(block))
    resolver = _Resolver()
    for node in ast.walk(tree):  # imports first, wherever they are, so every use below sees them
        if isinstance(node, ast.Import | ast.ImportFrom):
            resolver.visit(node)
    for node in tree.body:
        if not isinstance(node, ast.Import | ast.ImportFrom):
            resolver.visit(node)
    assert not resolver.problems, f"{block}: {'; '.join(resolver.problems)}"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.run], ids=str)
def test_runnable_block_runs(block: Block, tmp_path, monkeypatch):
    assert block.lang == "python", f"{block}: only Python blocks can be run"
    monkeypatch.chdir(tmp_path)
    module = ModuleType("doc_example")  # dataclasses and the Trainer look their class's module up by name
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(block.text, str(block), "exec"), module.__dict__)
    assert list(tmp_path.glob("runs/*/version_0/checkpoints/last.pt")), f"{block} trained nothing"


def test_the_callbacks_page_skip_counter_counts_a_skip_and_resumes_with_it(tmp_path, monkeypatch):
    """The page's own example callback, as written there, on a float16 run whose first loss is inf."""
    import torch
    import torch.nn.functional as F

    (block,) = [b for b in code_blocks(DOCS / "callbacks.md") if "class SkipCounter" in b.text]
    namespace: dict = {}
    exec(compile(block.text, str(block), "exec"), namespace)
    monkeypatch.chdir(tmp_path)

    class Overflowing(Trainer):
        def configure_model(self):
            return torch.nn.Linear(4, 1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.module.parameters(), lr=0.1)

        def train_dataloader(self):
            return [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]

        def training_step(self, batch):
            loss = F.mse_loss(self.model(batch[0]), batch[1])
            return loss * float("inf") if self.state.global_step == 0 else loss

    cfg = {"precision": {"opt_level": "O1", "dtype": "float16"}, "trainer": {"progress_bar": False}}
    counter = namespace["SkipCounter"]()
    Overflowing(cfg, callbacks=[counter]).fit()
    assert counter.skips == {0: 1}
    (last,) = tmp_path.glob("runs/run/version_0/checkpoints/last.pt")
    assert torch.load(last, weights_only=True)["callbacks"]["SkipCounter"] == {"skips": {0: 1}}
    resumed = namespace["SkipCounter"]()
    Overflowing({**cfg, "trainer": {"progress_bar": False, "max_epochs": 2}}, callbacks=[resumed]).fit(resume="last")
    assert resumed.skips == {0: 1}  # restored from the checkpoint; the second epoch skipped nothing


# ------------------------------------------------------------------------------------------------- bash


def commands(block: Block) -> list[list[str]]:
    """Each simple command of a bash block as argv: continuations joined, comments dropped, split at ``&&``,
    ``||``, ``;`` and ``|``, leading ``NAME=value`` environment settings removed, placeholders filled in."""
    text = block.text.replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        argv: list[str] = []
        for token in [*lexer, ";"]:
            if token and set(token) <= set(";&|"):
                while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
                    argv.pop(0)
                if argv:
                    found.append([PLACEHOLDERS.get(a, a) for a in argv])
                argv = []
            else:
                argv.append(token)
    return found


def _check_ampkit_cli(argv: list[str]) -> None:
    argv = [a for a in argv if a not in {"-h", "--help"}]  # --help exits; the rest must still parse
    try:
        args = cli._parse(cli._parser(argv), argv)
    except SystemExit:
        pytest.fail(f"`ampkit {' '.join(argv)}` does not parse (see the usage above)")
    if args.config in PLACEHOLDER_FILES:
        return
    trainer_class, cfg = load_config(args.config, args.overrides)
    trainer_class(cfg)  # checks every section, as the command would before training (it builds nothing yet)


def _check_script(path: str, args: list[str]) -> None:
    if path in PLACEHOLDER_FILES:
        return
    script = ROOT / path
    assert script.is_file(), f"{path} does not exist"
    source = script.read_text()
    for flag in (a.split("=")[0] for a in args if a.startswith("--")):
        assert f'"{flag}"' in source or f"'{flag}'" in source, f"{path} has no option {flag}"


def _check_python_module(module: str, args: list[str]) -> None:
    if module == "ampkit":
        _check_ampkit_cli(args)
    elif module == "ampkit.legacy":
        positional = [a for a in args if a != "--force-shim"]
        if not positional:  # the launcher itself, named
            return
        if positional[0] == "-m":  # what the launcher runs: an Apex module the shim serves (apex.parallel.multiproc)
            from ampkit.legacy import _missing_module

            missing = _missing_module(positional[1])
            assert missing is None, missing
        else:
            _check_script(positional[0], positional[1:])
    elif module == "pytest":
        for path in (a for a in args if not a.startswith("-")):
            assert (ROOT / path).exists(), f"pytest path {path} does not exist"
    else:
        assert module.startswith("ampkit."), f"python -m {module}: not a module of this project"
        assert importlib.util.find_spec(module) is not None, f"no module {module}"


def _check_pip(args: list[str]) -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = re.findall(r"^([\w-]+)\s*=", section, re.M)
    assert args[0] in ("install", "wheel"), f"pip {args[0]}"
    if args[0] == "wheel":  # building this checkout's wheel: the source directory is the project root
        assert args[-1] == ".", f"pip wheel {' '.join(args[1:])}: expected to build '.'"
        return
    for arg in args[1:]:
        named = re.search(r"\[([\w,-]+)\]$", arg)
        for extra in named.group(1).split(",") if named else []:
            assert extra in extras, f"pip install {arg}: no extra '{extra}' in pyproject.toml ({', '.join(extras)})"


def _check_launched(parsed: argparse.Namespace) -> None:
    """The program a launcher (torchrun, torch.distributed.launch) was told to start."""
    if parsed.module:
        _check_python_module(parsed.training_script, parsed.training_script_args)
    else:
        _check_script(parsed.training_script, parsed.training_script_args)


def check_command(argv: list[str]) -> None:
    program, args = argv[0], argv[1:]
    if program == "ampkit":
        _check_ampkit_cli(args)
    elif program == "python":
        if args[:2] == ["-m", "torch.distributed.launch"]:  # torchrun's older form: its parser and --use-env
            from torch.distributed.launch import parse_args

            _check_launched(parse_args(args[2:]))
        elif args[0] == "-m":
            _check_python_module(args[1], args[2:])
        else:
            _check_script(args[0], args[1:])
    elif program == "torchrun":
        from torch.distributed.run import get_args_parser

        _check_launched(get_args_parser().parse_args(args))
    elif program == "bash":
        assert (ROOT / args[0]).is_file(), f"bash {args[0]}: no such script"
    elif program == "pip":
        _check_pip(args)
    elif program == "mkdocs":
        assert args[0] in {"serve", "build"}, f"mkdocs {args[0]}"
    else:
        assert program in TOOLS, f"`{program}` is neither this project's command nor a documented tool"


@pytest.mark.parametrize("block", blocks_of("bash"), ids=str)
def test_bash_block_commands_exist_and_parse(block: Block, monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs run their commands from the repository root
    argvs = commands(block)
    assert argvs, f"{block}: no command"
    for argv in argvs:
        try:
            check_command(argv)
        except (AssertionError, ampkit.ConfigError) as exc:
            pytest.fail(f"{block}: `{shlex.join(argv)}`: {exc}")


def test_commands_split_as_a_shell_would():
    block = Block(ROOT, 1, "bash", "A=1 B=$PWD python x.py --a \\\n  --b  # note\nfoo 'k=[1]' && bar | baz\n", False)
    assert commands(block) == [["python", "x.py", "--a", "--b"], ["foo", "k=[1]"], ["bar"], ["baz"]]


# An inline command in prose (`ampkit fit --config gpt precision.opt_level=O0`); a synopsis with [optional],
# alternatives (a|b) or elisions (...) shows a form, not a command to run.
_INLINE_COMMAND = re.compile(
    r"`((?:[A-Z_]+=\S+ )*(?:ampkit (?:fit|validate|test|predict) |python |torchrun |bash )[^`\n]*)`"
)


def test_inline_commands_in_prose_exist_and_parse(monkeypatch):
    monkeypatch.chdir(ROOT)
    problems = []
    for page in PAGES:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for span in _INLINE_COMMAND.findall(prose):
            if re.search(r"\.\.\.|\[-|\||/path/to/", span):
                continue
            for argv in commands(Block(page, 0, "bash", span, False)):
                try:
                    check_command(argv)
                except (AssertionError, ampkit.ConfigError) as exc:
                    problems.append(f"{page.name}: `{span}`: {exc}")
    assert not problems, "\n".join(problems)


def test_readme_setup_commands_are_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    readme_installs = [
        line.strip() for b in code_blocks(ROOT / "README.md") if b.lang == "bash" for line in b.text.splitlines()
    ]
    installs = [line for line in readme_installs if line.startswith("pip install")]
    assert len(installs) >= 2, "the README's set-up commands (install + example, install + tests) are missing"
    ci_lines = {line.replace(" -q ", " ").strip() for line in ci.splitlines()}  # CI installs quietly
    for line in installs:
        assert line in ci_lines, f".ci/run no longer runs the README's `{line}`"


# ------------------------------------------------------------------------------------------------- YAML


@pytest.mark.parametrize("block", blocks_of("yaml"), ids=str)
def test_yaml_block_loads_against_its_schema(block: Block, monkeypatch):
    monkeypatch.chdir(ROOT)
    raw = OmegaConf.create(block.text)
    target = raw.get("trainer_class")
    if target:
        import_object(target)(build_config(import_object(target).config_class, raw))  # checked as `fit` would
    else:  # a fragment: its keys and values must be valid in the base schema
        check_values(build_config(Config, {"trainer_class": "x:Y"}, raw))


# ------------------------------------------------------------------------------------------------ prose

SECTIONS = [
    f.name
    for f in dataclasses.fields(Config)
    if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory())
]
_DOTTED = re.compile(rf"`((?:{'|'.join(SECTIONS)})\.[a-z_][a-z0-9_.]*)(?:[=:][^`]*)?`")


def test_dotted_config_keys_in_prose_exist():
    schema = OmegaConf.structured(Config)
    problems = []
    for page in PAGES:
        if page.name == "config_reference.md":
            continue
        for key in _DOTTED.findall(page.read_text()):
            key = key.rstrip(".")
            if re.search(r"\.(pt|py|yaml|md)$", key):
                continue  # a file name (`trainer.pt`), not a key
            if key.startswith("trainer.") and key.split(".")[1] in TRAINER_ATTRIBUTES:
                continue  # `trainer.state`, `trainer.log`: the Trainer object, not its config section
            if OmegaConf.select(schema, key, default="<missing>") == "<missing>":
                problems.append(f"{page.name}: {key}")
    assert not problems, f"config keys named in the docs that the schema lacks: {problems}"


def test_no_power_renders_as_bold():
    """``2**16`` outside a code span is Markdown emphasis: the page shows 2<b>16), ...</b>."""
    for page in PAGES:
        prose = re.sub(r"```.*?```|`[^`\n]*`", "", page.read_text(), flags=re.S)
        assert not re.search(r"\d\*\*-?\d", prose), f"{page.name}: write powers in a code span (`2**16`)"


def test_readme_links_point_at_files():
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"^[a-z]+://", target):
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


# -------------------------------------------------------------------------------------------- reference


def public_modules() -> list[ModuleType]:
    """ampkit, each subpackage that declares ``__all__``, and every module a public ``__all__`` exports."""
    names = ["ampkit"]
    for init in sorted((ROOT / "ampkit").rglob("__init__.py")):
        parts = init.parent.relative_to(ROOT).parts
        if not any(p.startswith("_") for p in parts) and re.search(r"^__all__", init.read_text(), re.M):
            names.append(".".join(parts))
    modules: dict[str, ModuleType] = {}
    queue = [importlib.import_module(n) for n in names]
    while queue:
        module = queue.pop()
        if module.__name__ in modules:
            continue
        modules[module.__name__] = module
        queue += [getattr(module, n) for n in module.__all__ if inspect.ismodule(getattr(module, n))]
    return [modules[n] for n in sorted(modules)]


PUBLIC_MODULES = public_modules()


def public_names() -> list[tuple[str, object]]:
    return [
        (f"{m.__name__}.{name}", getattr(m, name))
        for m in PUBLIC_MODULES
        for name in m.__all__
        if not inspect.ismodule(getattr(m, name))
    ]


def _has_attribute_docstring(module: ModuleType, name: str) -> bool:
    """A constant's docstring: the string right after its assignment, following ``from x import name``."""
    tree = ast.parse(inspect.getsource(module))
    for node, following in zip(tree.body, [*tree.body[1:], None], strict=True):
        targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            source = importlib.import_module(node.module if node.level == 0 else f"{module.__package__}.{node.module}")
            return _has_attribute_docstring(source, name)
    return False


def test_public_names_have_docstrings():
    missing = []
    for path, obj in public_names():
        if inspect.isclass(obj):
            documented = bool((obj.__dict__.get("__doc__") or "").strip())
        elif callable(obj):
            documented = bool((obj.__doc__ or "").strip())
        else:
            module, _, name = path.rpartition(".")
            documented = _has_attribute_docstring(importlib.import_module(module), name)
        if not documented:
            missing.append(path)
    assert not missing, f"public names without a docstring: {missing}"


def test_public_members_have_docstrings():
    """Methods and properties of public classes; an override may rely on the docstring of what it overrides
    (a callback's hook on ``Callback``'s, ``forward`` on ``nn.Module``'s)."""
    missing, seen = [], set()
    for path, cls in public_names():
        if not inspect.isclass(cls) or not cls.__module__.startswith("ampkit") or cls in seen:
            continue
        seen.add(cls)
        for name, member in vars(cls).items():
            if name.startswith("_"):
                continue
            if isinstance(member, property):
                doc = inspect.getdoc(member)
            elif inspect.isfunction(member) or isinstance(member, staticmethod | classmethod):
                doc = inspect.getdoc(getattr(cls, name))
            else:
                continue
            if not doc:
                missing.append(f"{path}.{name}")
    assert not missing, f"public methods and properties without a docstring: {missing}"


def _rendered_objects() -> tuple[set[int], list[str]]:
    """The objects the ``::: path`` directives of docs/api/ render, and the directives that resolve to nothing."""
    rendered, broken = set(), []
    for page in sorted((DOCS / "api").glob("*.md")):
        for path, options in re.findall(r"^::: ([\w.]+)\n((?:    .*\n)*)", page.read_text(), re.M):
            module_name, _, attr = path.rpartition(".")
            try:
                obj = importlib.import_module(path)
            except ImportError:
                obj = getattr(importlib.import_module(module_name), attr, None)
            if obj is None:
                broken.append(path)
                continue
            rendered.add(id(obj))
            if inspect.ismodule(obj) and hasattr(obj, "__all__"):
                excluded = re.findall(r'"!\^(\w+)\$"', options)
                rendered |= {id(getattr(obj, n)) for n in obj.__all__ if n not in excluded}
    return rendered, broken


def test_api_reference_renders_every_public_name():
    rendered, broken = _rendered_objects()
    assert not broken, f"docs/api directives naming nothing: {broken}"
    # An underscored name (compat's `_amp_state`) is Apex's, kept for old scripts: documented, not featured.
    unrendered = [
        path for path, obj in public_names() if id(obj) not in rendered and not path.rpartition(".")[2].startswith("_")
    ]
    assert not unrendered, f"public names no docs/api page renders (add a `::: name` directive): {unrendered}"


def test_every_top_level_name_is_in_the_api_overview():
    overview = (DOCS / "api" / "index.md").read_text()
    missing = [name for name in ampkit.__all__ if f"`ampkit.{name}`" not in overview]
    assert not missing, f"docs/api/index.md does not list: {missing}"


def test_hooks_page_shows_the_trainers_step_diagram_and_every_hook():
    module_doc = inspect.getmodule(Trainer).__doc__
    diagram = textwrap.dedent(module_doc.split("::\n\n", 1)[1].split("\n\n", 1)[0])
    page = (DOCS / "trainer.md").read_text()
    assert diagram in page, "docs/trainer.md's diagram differs from ampkit/trainer/trainer.py's docstring"
    missing = [hook for hook in HOOKS if f"`{hook}`" not in page]
    assert not missing, f"docs/trainer.md does not name the hooks {missing}"


@pytest.mark.parametrize("state", [LoopState, OptimizerState, LossState, BackwardState], ids=lambda c: c.__name__)
def test_shared_state_page_lists_every_field(state):
    page = (DOCS / "callbacks.md").read_text()
    missing = [f.name for f in dataclasses.fields(state) if not re.search(rf"^\| `{f.name}`|/ `{f.name}`", page, re.M)]
    assert not missing, f"docs/callbacks.md's table of {state.__name__} lacks {missing}"


def test_configuration_page_names_every_section():
    page = (DOCS / "configuration.md").read_text()
    missing = [s for s in SECTIONS if f"| `{s}` |" not in page]
    assert not missing, f"docs/configuration.md's table of sections lacks {missing}"


@pytest.mark.parametrize("section", ["trainer", "checkpoint", "early_stopping", "logging"])
def test_configuration_table_lists_every_key_of_the_sections_it_lists_by_key(section):
    """These rows name their keys one by one, so a key added to the schema must join its row."""
    row = re.search(rf"^\| `{section}` \| (.*) \|$", (DOCS / "configuration.md").read_text(), re.M)
    patterns = [p.replace("*", ".*") for p in re.findall(r"`([\w*]+)`", row.group(1))]
    fields = [f.name for f in dataclasses.fields(getattr(Config(), section))]
    missing = [name for name in fields if not any(re.fullmatch(p, name) for p in patterns)]
    assert not missing, f"docs/configuration.md's `{section}` row lacks {missing}"


def test_callbacks_page_lists_every_built_in_callback_in_its_phase():
    import ampkit.callbacks

    page = (DOCS / "callbacks.md").read_text()
    phase_rows = dict(re.findall(r"^\| `([A-Z]+)` \|.*\|(.*)\|$", page, re.M))
    problems = []
    for name in ampkit.callbacks.__all__:
        cls = getattr(ampkit.callbacks, name)
        if not (inspect.isclass(cls) and issubclass(cls, Callback)) or cls is Callback:
            continue
        if f"`{name}`" not in phase_rows.get(cls.phase.name, ""):
            problems.append(f"{name} is not in the phase table's {cls.phase.name} row")
        if not re.search(rf"^\| \[`{name}`\]", page, re.M):
            problems.append(f"{name} has no row in the built-in callbacks table")
    assert not problems, problems
