"""Pipeline specs: what `--pipeline NAME=SPEC` may say, and the checks a node makes before ranks.

Spec grammar: `tiny` (tiny text-to-image) · `tiny-video` (tiny text-to-video) · `tiny-dit`
(tiny Flux-style text-to-image, the one with speed modes) ·
`tiny-img2img`, `tiny-inpaint`, `tiny-i2v` (their components, image-conditioned) ·
`diffusers:<folder or hub id>` · `python:<module>:<factory>` (a `PipelineFactory`, called with
the device; docs/pipelines.md).

A `python:` module is imported from `sys.path` and then from the working directory, so a
pipeline module beside the worker is found without `PYTHONPATH`. Ranks are spawned with the
worker's working directory, so they find it alike.

`check_spec_form` is plain parsing and file checks, no torch: `kiln worker` runs it first, so a
misspelled spec is refused before anything heavy loads. `check_python_spec` imports the module and
looks at its factory without calling it (that loads the model; the ranks do it, and
`kiln pipeline check` does it in-process). Each refusal is a `SpecError`: one line. Neither loads
torch (only a user's module may): `kiln worker` runs both before anything heavy is imported. What
only the load shows, a rank reports as a `PipelineRefused`, one line as well.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# spec -> (the tiny pipeline whose folder it loads, the diffusers class it runs as, options)
TINY_VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tiny-img2img": ("tiny", "StableDiffusionImg2ImgPipeline", {"requires_safety_checker": False}),
    "tiny-inpaint": ("tiny", "StableDiffusionInpaintPipeline", {"requires_safety_checker": False}),
    "tiny-i2v": ("tiny-video", "WanImageToVideoPipeline", {"expand_timesteps": True}),
}
TINY_SPECS = frozenset({"tiny", "tiny-video", "tiny-dit", *TINY_VARIANTS})
SPEC_GRAMMAR = (
    "tiny | tiny-video | tiny-dit | tiny-img2img | tiny-inpaint | tiny-i2v | "
    "diffusers:<folder or hub id> | python:<module>:<factory>"
)
# What marks a diffusers target as a folder rather than a hub id (`org/name`).
_PATH_PREFIXES = ("/", "./", "../", "~")
# The members of the `Pipeline` protocol (gpu_worker/pipelines/base.py), named once here, where no
# torch is loaded, so that a factory is checked before anything heavy is imported.
PIPELINE_MEMBERS: tuple[str, ...] = ("name", "supported_fields", "validate", "run", "denoiser")


class SpecError(ValueError):
    """A pipeline spec that cannot be served; the message is one line naming what is wrong."""


class NotAPipeline(SpecError, TypeError):
    """A `python:` factory made something that is not a `Pipeline`."""


class _RankReported(Exception):
    """A pipeline fault a rank sends its owner as one marked line instead of a traceback.

    The rank sends `rank_message()`; its owner's start-up error carries that text, where
    `found_in` reads it back, so the worker says it in one line. Each subclass has its MARK.
    """

    MARK = ""  # starts the line a rank sends; JSON [name, reason] follows

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"pipeline {name}: {reason}")
        self.name = name
        self.reason = reason

    def rank_message(self) -> str:
        """The one line a rank sends its owner in place of a traceback."""
        return self.MARK + json.dumps([self.name, self.reason])

    @classmethod
    def found_in(cls, text: str) -> typing.Self | None:
        """The fault a rank's `rank_message()` carries within `text` (an error's), or None."""
        for line in text.splitlines():
            if line.startswith(cls.MARK):
                try:
                    name, reason = json.loads(line.removeprefix(cls.MARK))
                except (ValueError, TypeError):  # not a rank's line after all
                    return None
                return cls(str(name), str(reason))
        return None


class PipelineFailed(_RankReported, RuntimeError):
    """A rank could not load or warm up pipeline `name` (`reason`: the error, in one line).

    Not the spec's form (that is `PipelineRefused`): the model's files did not load (network,
    cache, memory) or the factory or the first run raised. The worker ends in one line with
    exit 1, as `kiln pipeline check` does for the same fault.
    """

    MARK = "pipeline failed: "


class PipelineRefused(_RankReported, SpecError):
    """A rank could not load pipeline `name` for a fault of its spec (`reason`, one line).

    What only loading shows: a factory declared to return a `Pipeline` that returns something
    else, or a module the rank cannot import. The worker says it in one line and exits as for a
    spec refused before any rank started.
    """

    MARK = "pipeline refused: "


@dataclass(frozen=True)
class PipelineSpec:
    """A parsed spec: its kind (`tiny`, `diffusers`, `python`) and what it points at."""

    text: str
    kind: str
    target: str = ""  # the diffusers folder or hub id
    module: str = ""  # python: the module
    factory: str = ""  # python: the factory's name in the module


# What a rank imports to load a spec of each kind (gpu_worker/pipelines/__init__.py). The rank
# server imports these before it forks (gpu_worker/rank_server.py), so a node's ranks find them
# done; a node that serves no diffusers pipeline never imports diffusers. A `python:` module is
# the user's own: each rank imports it, the server never does (a module may initialise CUDA at
# import, and a forked rank must not inherit that).
_DIFFUSERS_LOADER = "kiln.gpu_worker.pipelines.diffusers_pipeline"  # diffusers, transformers
LOADER_MODULES: dict[str, tuple[str, ...]] = {
    "tiny": (_DIFFUSERS_LOADER, "kiln.gpu_worker.pipelines.tiny"),
    "diffusers": (_DIFFUSERS_LOADER,),
    "python": (),
}


def loader_modules(specs: typing.Iterable[str]) -> frozenset[str]:
    """The modules ranks import to load `specs` (none for a spec that does not parse)."""
    modules: set[str] = set()
    for spec in specs:
        try:
            modules.update(LOADER_MODULES[parse_spec(spec).kind])
        except SpecError:  # refused where specs are checked, not here
            continue
    return frozenset(modules)


def tiny_base(spec: str) -> str:
    """The tiny pipeline whose folder `spec` loads (`spec` itself unless it is a variant)."""
    return TINY_VARIANTS[spec][0] if spec in TINY_VARIANTS else spec


def parse_spec(spec: str) -> PipelineSpec:
    """The parts of `spec`; `SpecError` when it follows no form of the grammar."""
    if spec in TINY_SPECS:
        return PipelineSpec(spec, "tiny")
    scheme, _, target = spec.partition(":")
    if scheme == "diffusers" and target:
        return PipelineSpec(spec, "diffusers", target=target)
    if scheme == "python":
        module, _, factory = target.partition(":")
        if not module or not factory or ":" in factory:
            raise SpecError(f"pipeline spec {spec!r}: expected python:<module>:<factory>")
        return PipelineSpec(spec, "python", module=module, factory=factory)
    raise SpecError(f"unknown pipeline spec {spec!r}; expected {SPEC_GRAMMAR}")


def check_spec_form(spec: str) -> PipelineSpec:
    """Parse `spec` and check what needs no import of the model's code.

    A diffusers folder exists and holds a saved pipeline; a `python:` module can be found (found,
    not imported: its import is `check_python_spec`'s).
    """
    parsed = parse_spec(spec)
    if parsed.kind == "diffusers":
        _check_diffusers_target(parsed)
    elif parsed.kind == "python":
        _check_module_findable(parsed)
    return parsed


def _check_module_findable(parsed: PipelineSpec) -> None:
    make_working_directory_importable()
    try:
        found = importlib.util.find_spec(parsed.module) is not None
    except ModuleNotFoundError:  # a parent package of a dotted name is missing
        found = False
    except Exception:  # a parent package failed to import: `import_factory` says how
        return
    if not found:
        raise _no_module(parsed)


def _no_module(parsed: PipelineSpec) -> SpecError:
    return SpecError(
        f"{parsed.text}: no module named {parsed.module!r} in {os.getcwd()} or on PYTHONPATH"
    )


def _check_diffusers_target(parsed: PipelineSpec) -> None:
    folder = Path(parsed.target).expanduser()
    if folder.is_dir():
        if not (folder / "model_index.json").is_file():
            raise SpecError(
                f"{parsed.text}: folder {folder} has no model_index.json, so it is not a saved "
                "diffusers pipeline"
            )
        return
    if parsed.target.startswith(_PATH_PREFIXES) or folder.exists():
        raise SpecError(f"{parsed.text}: no such folder {folder}")
    parts = parsed.target.split("/")
    if len(parts) > 2 or not all(parts) or any(p.startswith(("-", ".")) for p in parts):
        # diffusers would try it as a hub id and fail with huggingface_hub's validation error
        raise SpecError(
            f"{parsed.text}: {parsed.target!r} is neither a folder here nor a hub id (<org>/<name>)"
        )
    _check_cached_when_offline(parsed)


def _check_cached_when_offline(parsed: PipelineSpec) -> None:
    """A hub id with HF_HUB_OFFLINE set must be in the local cache: found now, not at load.

    Loading finds it only after diffusers and the model libraries have loaded in each rank
    (18 s here), and says so in 136 lines; huggingface_hub answers from the cache in 0.5 s.
    """
    from huggingface_hub import constants, try_to_load_from_cache

    if not constants.HF_HUB_OFFLINE:
        return
    if isinstance(try_to_load_from_cache(parsed.target, "model_index.json"), str):
        return
    raise SpecError(
        f"{parsed.text}: {parsed.target} is not in the Hugging Face cache "
        f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE forbids downloading it: download it "
        f"first (hf download {parsed.target}) or unset HF_HUB_OFFLINE"
    )


def make_working_directory_importable() -> None:
    """Let `python:` modules in the working directory import, after everything on `sys.path`.

    `python -m` puts the working directory first on `sys.path`, a console script (`kiln`) does
    not; appended, it never shadows an installed package.
    """
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)


def import_factory(parsed: PipelineSpec) -> Any:
    """The factory a `python:` spec names, imported; `SpecError` naming why it cannot be."""
    make_working_directory_importable()
    try:
        module = importlib.import_module(parsed.module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and parsed.module.startswith(exc.name):
            raise _no_module(parsed) from None
        raise SpecError(f"{parsed.text}: importing {parsed.module} failed: {exc}") from None
    except Exception as exc:  # the user's module raised while importing: say where
        raise SpecError(
            f"{parsed.text}: importing {parsed.module} raised {one_line(exc)}{_where(exc)}"
        ) from None
    factory = getattr(module, parsed.factory, None)
    if factory is None:
        raise SpecError(
            f"{parsed.text}: module {parsed.module} ({_file_of(module)}) has no {parsed.factory!r}"
        )
    return factory


def check_python_spec(parsed: PipelineSpec, members: tuple[str, ...] = PIPELINE_MEMBERS) -> None:
    """Import a `python:` spec's module and check its factory without calling it.

    `members` are the `Pipeline` protocol's members. The factory must be callable with one
    argument (the device) and say what it makes: be a class, or declare its return type (a
    class, a union of classes, or the `Pipeline` protocol itself), as cog's predictors declare
    theirs. Each class it names must define the protocol's methods. Calling the factory would
    load the model, so what it declares is what is checked here; what it actually returns is
    checked again where it is called, in the ranks (`NotAPipeline`).
    """
    factory = import_factory(parsed)
    if not callable(factory):
        raise NotAPipeline(
            f"{parsed.text}: {parsed.factory} is a {type(factory).__name__}, not a factory; "
            "expected a function or class called with the device"
        )
    _check_takes_device(parsed, factory)
    made = [factory] if inspect.isclass(factory) else _declared_classes(parsed, factory)
    for cls in made:
        missing = [m for m in members if not _class_has(cls, m)]
        if missing:
            raise NotAPipeline(
                f"{parsed.text}: {parsed.factory} makes {cls.__name__}, which is not a Pipeline:"
                f" it lacks {', '.join(missing)} (docs/pipelines.md)"
            )


def _check_takes_device(parsed: PipelineSpec, factory: Any) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # a builtin without a signature: it is called as it is
    try:
        signature.bind("cpu")
    except TypeError:
        raise SpecError(
            f"{parsed.text}: {parsed.factory}{signature} cannot be called with one argument "
            "(the device)"
        ) from None


def _declared_classes(parsed: PipelineSpec, factory: Any) -> list[type]:
    """The classes `factory`'s return annotation names; none for the `Pipeline` protocol itself.

    A factory that declares nothing, or nothing that is a class, is refused: what it makes could
    only be learnt by calling it, which loads the model, and would surface only after every rank
    had started.
    """
    name = parsed.factory
    try:
        hints = typing.get_type_hints(factory)
    except Exception as exc:
        raw = getattr(factory, "__annotations__", {}).get("return")
        raise NotAPipeline(
            f"{parsed.text}: {name}'s return annotation {raw!r} does not resolve "
            f"({one_line(exc)}); import the class it names at the module's top level"
        ) from None
    if "return" not in hints:
        raise NotAPipeline(
            f"{parsed.text}: {name} does not say what it makes; declare the pipeline class it "
            f"returns (def {name}(device) -> MyPipeline:) so that it is checked before any rank "
            "loads the model (docs/pipelines.md)"
        )
    declared = hints["return"]
    members = typing.get_args(declared) if _is_union(declared) else (declared,)
    if not all(inspect.isclass(member) and member is not Any for member in members):
        raise NotAPipeline(
            f"{parsed.text}: {name} declares it returns {_type_name(declared)}, which names no "
            "pipeline class; declare the class it returns (docs/pipelines.md)"
        )
    # The protocol itself promises the members; what is returned is checked where it is called.
    return [member for member in members if not getattr(member, "_is_protocol", False)]


def _is_union(declared: Any) -> bool:
    return typing.get_origin(declared) in (typing.Union, types.UnionType)


def _type_name(declared: Any) -> str:
    return getattr(declared, "__name__", None) or str(declared).removeprefix("typing.")


def _class_has(cls: type, member: str) -> bool:
    # `name` is often set in __init__: an annotation or a class attribute counts as well.
    if member == "name":
        return True
    return callable(getattr(cls, member, None))


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and its message, whitespace folded."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _where(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" ({exc.filename}:{exc.lineno})"
    frames = inspect.getinnerframes(exc.__traceback__) if exc.__traceback__ else []
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _file_of(module: Any) -> str:
    return str(getattr(module, "__file__", None) or module.__name__)
