"""Provenance of a reusable artifact (a pipeline stage's checkpoint): what made it, so that a rerun
reuses it only when the same source, options and output format would make it again.

    record_artifact(artifact, source, options)     after the stage wrote `artifact`
    reuse_problem(artifact, source, options)       None: reuse it; else why not (rebuild it)
    adopt_artifact(built, artifact, source, options)  `built` (made elsewhere, e.g. by `kvconvert plan`)
                                                   becomes `artifact` when its record matches
    stage_record(stage, options, **makes)          the `options` of a pipeline stage (and of the plan's
                                                   builds of the same stage)

The records live beside the artifacts, in PROVENANCE_FILE of their parent folder (the pipeline's
--out), one entry per artifact folder name; the checkpoint folders themselves stay as the stages
wrote them. A record holds:

- format_version: ARTIFACT_FORMAT, bumped when a stage's output format changes;
- source and source_fingerprint: the input model's path and weight identity
  (kvconvert.checkpoint.fingerprint: per-file sha256, an in-place edit changes it);
- options: the stage's options as JSON (every field, defaults included);
- artifact_fingerprint: the artifact's own identity when it was recorded, so an artifact rewritten
  since (by hand or by another command) is not taken for the recorded one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from kvconvert import __version__
from kvconvert.checkpoint.fingerprint import checkpoint_fingerprint
from kvconvert.checkpoint.writer import atomic_write_text

ARTIFACT_FORMAT = 1
PROVENANCE_FILE = "provenance.json"


def _records(folder: Path) -> dict:
    try:
        records = json.loads((folder / PROVENANCE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def _as_json(options) -> object:
    """The options as they read back from JSON (tuples -> lists, paths -> strings)."""
    return json.loads(json.dumps(options, sort_keys=True, default=str))


def record_artifact(artifact: Path, source: Path, options) -> dict:
    """Write the provenance of `artifact` (just built from `source` with `options`)."""
    artifact = Path(artifact)
    record = {"format_version": ARTIFACT_FORMAT, "producer": f"kvconvert {__version__}", "source": str(source),
              "source_fingerprint": checkpoint_fingerprint(source), "options": _as_json(options),
              "artifact_fingerprint": checkpoint_fingerprint(artifact)}
    records = _records(artifact.parent)
    records[artifact.name] = record
    atomic_write_text(artifact.parent / PROVENANCE_FILE, json.dumps(records, indent=1) + "\n")
    return record


def _flat(value: object, prefix: str = "") -> dict:
    """{"a.b": leaf} of nested dicts (a non-dict is one leaf under `prefix`)."""
    if not isinstance(value, dict) or not value:
        return {prefix: value}
    flat = {}
    for key, inner in value.items():
        flat.update(_flat(inner, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def option_changes(was: object, now: object) -> str:
    """'calib_tokens 16384 -> 8192, heal_distill.lr 0.0005 -> 0.001, ...' for two option dicts (nested keys
    dotted), or the two values."""
    if not (isinstance(was, dict) and isinstance(now, dict)):
        return f"{was} -> {now}"
    was, now = _flat(was), _flat(now)
    keys = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
    shown = [f"{k} {json.dumps(was.get(k))} -> {json.dumps(now.get(k))}" for k in keys[:4]]
    return ", ".join(shown) + (f" (and {len(keys) - 4} more)" if len(keys) > 4 else "")


def reuse_problem(artifact: Path, source: Path, options) -> str | None:
    """None when `artifact` was recorded as built from this `source` (same weights) with these
    `options` and this format, and is unchanged since; otherwise the reason it cannot be reused."""
    artifact = Path(artifact)
    record = _records(artifact.parent).get(artifact.name)
    if not isinstance(record, dict):
        return f"it has no provenance record ({artifact.parent / PROVENANCE_FILE}): made by an older kvconvert " \
               "or another command, its source and options are unknown"
    if record.get("format_version") != ARTIFACT_FORMAT:
        return f"it was written in artifact format {record.get('format_version')}, this kvconvert writes " \
               f"{ARTIFACT_FORMAT}"
    now = checkpoint_fingerprint(source)
    if record.get("source_fingerprint") != now:
        return f"it was built from other weights ({record.get('source')}, fingerprint " \
               f"{record.get('source_fingerprint')}; {source} is {now})"
    if record.get("options") != _as_json(options):
        return f"it was built with other options ({option_changes(record.get('options'), _as_json(options))})"
    if record.get("artifact_fingerprint") != checkpoint_fingerprint(artifact):
        return "its files changed since it was built"
    return None


def stage_record(stage: str, options, **makes) -> dict:
    """What decides a stage's output besides its source's weights: the stage's name, its options (a
    StageOptions, as JSON; the device left out: it moves the work, not what is made) and `makes` (more of
    what decides it, e.g. the heal recipe). The pipeline's stages and the plan's builds of the same
    stages record this, so an artifact the plan built is reused by the pipeline only when it would have
    built the same one."""
    dumped = None if options is None else options.model_dump(mode="json", exclude={"device"})
    return {"stage": stage, "options": dumped, **makes}


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link (no bytes copied; every writer replaces files whole, so the two names never diverge
    in place), or a copy where the filesystem has none."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def adopt_artifact(built: Path, artifact: Path, source: Path, options) -> str | None:
    """Make `built` (a finished checkpoint folder with a provenance record, e.g. one `kvconvert plan`
    built) the `artifact` folder too, when its record says it was built from `source`'s weights with
    `options` and it is unchanged since (reuse_problem); its files are hard-linked (copied where links
    are impossible) into a temp folder beside `artifact`, which then replaces `artifact`, and the record
    is written for `artifact`. Returns None when adopted, else why not (nothing is touched then)."""
    built, artifact = Path(built), Path(artifact)
    problem = reuse_problem(built, source, options)
    if problem is not None:
        return problem
    tmp = artifact.parent / f".{artifact.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    artifact.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(built, tmp, copy_function=_link_or_copy)
    if artifact.exists():
        old = artifact.parent / f".{artifact.name}.old-{os.getpid()}"
        artifact.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    tmp.rename(artifact)
    record_artifact(artifact, source, options)
    return None
