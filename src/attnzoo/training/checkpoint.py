"""Checkpoints written atomically: an interrupted save never replaces a good checkpoint with a half-written one,
and a run stopped at any moment (even by ``kill -9``) can be continued.

Layout of a run's output directory::

    OUTPUT/run.json                                    the run's config, written before its first step
    OUTPUT/checkpoints/step-000500/model.safetensors   weights (and buffers) of the model
                                  /config.json         the TrainConfig and what the task was built with
                                  /state.pt            optimiser, schedule, step and RNG state
                                  /manifest.json       size and SHA-256 of each file above
    OUTPUT/checkpoints/LATEST                          name of the newest complete checkpoint

A checkpoint is written into a temporary directory (``checkpoints/.step-000500.*``), flushed to disk, renamed
into place, and only then named in ``LATEST`` (itself replaced by an atomic rename of ``checkpoints/.LATEST.*``);
older checkpoints are removed after that. A reader follows ``LATEST``, so it sees the previous checkpoint or the
new one, never a mixture, whenever the writer stops.

The rules for a run stopped at any moment:

* ``LATEST`` is the commit point. A checkpoint it does not name does not count, even if complete (a save
  stopped between the rename and ``LATEST``): the run continues from the one ``LATEST`` names, which ends
  bit-identical anyway, since a resumed run redoes the same steps.
* A run stopped before ``LATEST`` was first written (before or during its first save) has ``run.json`` and no
  checkpoint: continuing it (:func:`find_run`) starts it afresh from step 0 with the config of ``run.json``;
  a new run may also be started in its directory (:func:`stopped_before_first_checkpoint` says so).
* The next start of a run in the directory (:func:`begin_run`) removes what a stopped save left behind:
  temporary files and directories (names beginning with a dot) and checkpoints ``LATEST`` does not name. A
  run started from step 0 first removes ``LATEST`` (a run in that directory before it is replaced), then
  records its own ``run.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

CHECKPOINTS = "checkpoints"
LATEST = "LATEST"
RUN = "run.json"  # in the output directory: the run's config, so a run stopped before its first checkpoint resumes
WEIGHTS, CONFIG, STATE, MANIFEST = "model.safetensors", "config.json", "state.pt", "manifest.json"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or made for another configuration."""


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open a directory; the renames are still atomic there
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json_atomically(path: Path, data: Any) -> None:
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.chmod(temporary, 0o644)  # mkstemp makes it private; a checkpoint is as readable as any other output
    with os.fdopen(descriptor, "w") as handle:
        json.dump(data, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def save_checkpoint(
    output: Union[str, Path], step: int, model: nn.Module, config: Dict[str, Any], state: Dict[str, Any]
) -> Path:
    """Write the checkpoint of ``step`` under ``output/checkpoints`` and make it the latest; returns its path.

    ``config`` must be JSON-serialisable; ``state`` is saved with :func:`torch.save` and must hold only tensors,
    numbers, strings and containers of them (so that it loads with ``weights_only=True``).
    """
    from safetensors.torch import save_model

    root = Path(output) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    temporary = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}."))
    try:
        temporary.chmod(0o755)
        save_model(model, str(temporary / WEIGHTS), metadata={"format": str(FORMAT_VERSION)})
        (temporary / CONFIG).write_text(json.dumps({"format": FORMAT_VERSION, **config}, indent=2))
        torch.save({"step": step, **state}, temporary / STATE)
        manifest = {file: {"bytes": (temporary / file).stat().st_size, "sha256": _sha256(temporary / file)}
                    for file in (WEIGHTS, CONFIG, STATE)}
        (temporary / MANIFEST).write_text(json.dumps(manifest, indent=2))
        for file in (WEIGHTS, CONFIG, STATE, MANIFEST):
            _fsync_file(temporary / file)
        final = root / name
        if final.exists():  # the same step saved again (an evaluation step that is also the last)
            shutil.rmtree(final)
        os.rename(temporary, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    latest = root / LATEST
    _write_json_atomically(latest, {"checkpoint": name, "step": step})
    _fsync_dir(root)
    for old in root.iterdir():  # the newest checkpoint is complete and named: the rest can go
        if old.name != name and old.name != LATEST and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return final


def find_checkpoint(path: Union[str, Path]) -> Path:
    """The checkpoint directory that ``path`` names: a run's output directory (its latest checkpoint), its
    ``checkpoints`` directory, or a checkpoint directory itself. A clear :class:`CheckpointError` otherwise."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory")
    if (path / MANIFEST).exists() or (path / CONFIG).exists():
        return path
    root = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
    latest = root / LATEST
    if not latest.exists() and root.name == CHECKPOINTS and root.is_dir():
        raise CheckpointError(f"{path}: no checkpoint here, and no {RUN} (the run stopped before recording its "
                              "settings): start it again with attnzoo train TASK --output DIR")
    if not latest.exists():
        raise CheckpointError(f"{path}: no checkpoint here (expected {CHECKPOINTS}/{LATEST} written by attnzoo train)")
    try:
        name = json.loads(latest.read_text())["checkpoint"]
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{latest}: unreadable ({error})") from None
    checkpoint = root / str(name)
    if not checkpoint.is_dir():
        raise CheckpointError(f"{latest} names {name}, which is missing")
    return checkpoint


def verify_checkpoint(checkpoint: Path) -> None:
    """Every file present, of the recorded size and SHA-256: a truncated or altered file is named."""
    manifest_path = checkpoint / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{checkpoint}: incomplete checkpoint (no {MANIFEST})") from None
    except ValueError as error:
        raise CheckpointError(f"{manifest_path}: corrupt ({error})") from None
    for file in (WEIGHTS, CONFIG, STATE):
        path = checkpoint / file
        expected = manifest.get(file) if isinstance(manifest, dict) else None
        if not isinstance(expected, dict):
            raise CheckpointError(f"{manifest_path}: corrupt (no entry for {file})")
        if not path.exists():
            raise CheckpointError(f"{checkpoint}: incomplete checkpoint ({file} is missing)")
        size = path.stat().st_size
        if size != expected.get("bytes"):
            raise CheckpointError(f"{path}: truncated or altered ({size} bytes, {expected.get('bytes')} written)")
        if _sha256(path) != expected.get("sha256"):
            raise CheckpointError(f"{path}: corrupt (its SHA-256 differs from the one written with it)")


def read_config(checkpoint: Path) -> Dict[str, Any]:
    """The JSON config saved with a verified checkpoint (without the format field)."""
    verify_checkpoint(checkpoint)
    data = json.loads((checkpoint / CONFIG).read_text())
    version = data.pop("format", None)
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{checkpoint}: checkpoint format {version!r}, this attnzoo reads {FORMAT_VERSION}")
    return data


def load_weights(checkpoint: Path, model: nn.Module) -> None:
    """Load the checkpoint's weights into ``model``; a model of another shape is a :class:`CheckpointError`."""
    from safetensors.torch import load_model

    try:
        load_model(model, str(checkpoint / WEIGHTS), strict=True)
    except Exception as error:  # noqa: BLE001 - safetensors and torch raise several types for the same fault
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"{checkpoint / WEIGHTS}: does not fit the model its config.json describes ({first[:300]})"
        ) from None


def load_state(checkpoint: Path) -> Dict[str, Any]:
    """The optimiser, schedule, step and RNG state saved with the checkpoint."""
    try:
        return torch.load(checkpoint / STATE, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - unpickling errors come in many types
        raise CheckpointError(f"{checkpoint / STATE}: unreadable ({type(error).__name__}: {error})") from None


# -- runs stopped at any moment ----------------------------------------------------------------------------------
def read_run(output: Union[str, Path]) -> Optional[Dict[str, Any]]:
    """The config a run recorded in ``output/run.json`` when it started (without the format field), or None if
    it recorded none."""
    path = Path(output) / RUN
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from None
    version = data.pop("format", None) if isinstance(data, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: run format {version!r}, this attnzoo reads {FORMAT_VERSION}")
    return data


def stopped_before_first_checkpoint(output: Union[str, Path]) -> bool:
    """Whether ``output`` holds a run that wrote no complete checkpoint: it has ``run.json`` or a
    ``checkpoints`` directory, but no ``checkpoints/LATEST`` (stopped before or during its first save)."""
    output = Path(output)
    if (output / CHECKPOINTS / LATEST).exists():
        return False
    return (output / RUN).is_file() or (output / CHECKPOINTS).is_dir()


def find_run(output: Union[str, Path]) -> Tuple[Optional[Path], Dict[str, Any]]:
    """(the latest complete checkpoint, or None for a run stopped before its first one; the run's saved config).

    ``output`` is what :func:`find_checkpoint` takes. A run directory without ``checkpoints/LATEST`` is continued
    from step 0 with the config of its ``run.json``; without that either, it is not a run
    (:class:`CheckpointError`)."""
    output = Path(output)
    if stopped_before_first_checkpoint(output) and not (output / MANIFEST).exists():
        saved = read_run(output)
        if saved is not None:
            return None, saved
    checkpoint = find_checkpoint(output)
    return checkpoint, read_config(checkpoint)


def stale_files(output: Union[str, Path]) -> List[Path]:
    """What stopped saves left in ``output``: temporary files and directories (``checkpoints/.LATEST.*``,
    ``checkpoints/.step-*``, ``.run.json.*``) and checkpoints ``LATEST`` does not name (all of them when there
    is no ``LATEST``)."""
    output = Path(output)
    root = output / CHECKPOINTS
    stale = sorted(output.glob(f".{RUN}.*"))
    if not root.is_dir():
        return stale
    latest = root / LATEST
    try:
        kept: Optional[str] = str(json.loads(latest.read_text())["checkpoint"])
    except FileNotFoundError:
        kept = None  # no LATEST: no checkpoint counts
    except (OSError, ValueError, KeyError, TypeError):
        kept = LATEST  # unreadable: the checkpoints are left alone, for find_checkpoint to name the fault
    return stale + sorted(entry for entry in root.iterdir() if entry.name.startswith(".")
                          or (kept != LATEST and entry.is_dir() and entry.name != kept))


def begin_run(output: Union[str, Path], config: Dict[str, Any], resumed: Optional[Path]) -> None:
    """Ready ``output`` for a run that starts now: remove what stopped saves left (:func:`stale_files`); a run
    that starts from step 0 (``resumed`` None) also removes a previous run's ``LATEST`` and records ``config``
    (JSON-serialisable, as given to :func:`save_checkpoint`) in ``run.json``."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    if resumed is None:
        (output / CHECKPOINTS / LATEST).unlink(missing_ok=True)
    for path in stale_files(output):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if resumed is None:
        _write_json_atomically(output / RUN, {"format": FORMAT_VERSION, **config})
        _fsync_dir(output)
