"""What the distillation teacher is, recorded in each checkpoint and compared on resume
(docs/grpo_loss.md, "On-policy distillation"): a resumed run must keep its teacher, wherever it
now lives (another directory, a restarted server on another port or host), and must not take
another one under the same path or URL.

- An in-process teacher (grpo.distill.teacher): a digest of its weight files (names, sizes and
  content of ``*.safetensors``; BLAKE2b, about a second per GB, once per launch, in the driver).
- A served teacher (grpo.distill.teacher_url): its log-probs of a fixed probe sequence
  (rlbatch.grpo.served_teacher.PROBE), asked of the server. The same checkpoint served again gives the same numbers
  to within :data:`PROBE_TOLERANCE`; another model differs by far more.

The driver computes it before launch (:func:`teacher_identity`), hands it to the trainer through
the run directory (:data:`FILE`, read into each checkpoint's meta.json as ``"teacher"``) and
compares it with the resumed checkpoint's (:func:`identity_errors`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from rlbatch.config.errors import ConfigError

FILE = "teacher_identity.json"
"""In the run directory: the identity the driver computed for this launch."""
PROBE_TOLERANCE = 1e-3
"""Nats: the largest probe log-prob difference taken as the same served teacher (a restarted
server of the same checkpoint repeats its numbers to ~1e-6 in fp32)."""
CHUNK = 8 << 20


def files_digest(folder: Path) -> str:
    """BLAKE2b of the names, sizes and bytes of ``folder``'s ``*.safetensors``."""
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            while block := fh.read(CHUNK):
                h.update(block)
    return h.hexdigest()


def teacher_identity(cfg: Any) -> Optional[dict[str, Any]]:
    """The teacher's identity (None: no teacher, or a served one that cannot be asked, which
    the preflight has already refused)."""
    d = cfg.grpo.distill
    if d.teacher:
        return {"kind": "files", "digest": files_digest(Path(d.teacher)), "where": str(d.teacher)}
    if d.teacher_url:
        from rlbatch.grpo.served_teacher import PROBE, TeacherServerError, score_sequence

        url = str(d.teacher_url).rstrip("/")
        try:
            logps = score_sequence(url, PROBE, 1, timeout_s=d.teacher_timeout_s, what="the probe")
        except TeacherServerError:
            return None
        return {"kind": "probe", "logps": logps, "where": url}
    return None


def same_teacher(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    if saved.get("kind") != now.get("kind"):
        return False
    if saved["kind"] == "files":
        return bool(saved.get("digest") == now.get("digest"))
    a, b = saved.get("logps") or [], now.get("logps") or []
    if not a or len(a) != len(b):
        return False
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) <= PROBE_TOLERANCE


def saved_identity(checkpoint: Path) -> Optional[dict[str, Any]]:
    """The teacher identity a checkpoint was written with (None: none, or an older rlbatch)."""
    try:
        found = json.loads((checkpoint / "meta.json").read_text()).get("teacher")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, dict) else None


def identity_errors(
    cfg: Any, saved: dict[str, Any], now: Optional[dict[str, Any]], checkpoint: Path
) -> list[ConfigError]:
    """An error naming the teacher's key when the teacher of this launch is not the one the
    checkpoint was trained with."""
    if now is not None and same_teacher(saved, now):
        return []
    key = "grpo.distill.teacher_url" if cfg.grpo.distill.teacher_url else "grpo.distill.teacher"
    value = cfg.grpo.distill.teacher_url or cfg.grpo.distill.teacher
    what = (
        "the digest of its *.safetensors differs"
        if saved.get("kind") == "files" and (now or {}).get("kind") == "files"
        else f"its log-probs of a fixed probe differ by more than {PROBE_TOLERANCE} nats"
        if saved.get("kind") == "probe" and (now or {}).get("kind") == "probe"
        else "one is built in-process and the other served"
    )
    return [
        ConfigError(
            key,
            value,
            f"is not the teacher {checkpoint} was trained with (then {saved.get('where')}):"
            f" {what}. A resumed run keeps its teacher; it may move (another directory, a"
            " restarted server at another URL), not change. Point it at the same teacher, or"
            " start a new run (another directory, trainer.resume=none)",
        )
    ]


def write_identity(run_dir: Path, identity: Optional[dict[str, Any]]) -> None:
    """Hand this launch's identity to the trainer (:func:`read_identity`)."""
    path = Path(run_dir) / FILE
    if identity is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(identity) + "\n")


def read_identity(run_dir: str) -> Optional[dict[str, Any]]:
    try:
        found = json.loads((Path(run_dir) / FILE).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
