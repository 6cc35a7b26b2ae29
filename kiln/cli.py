"""``kiln``: the command line over the SDK.

    kiln upload train.jsonl                 kiln create --model kiln-tiny --training-file file-… --watch
    kiln jobs                               kiln watch ftjob-…          kiln logs ftjob-… [--follow]
    kiln cancel ftjob-…                     kiln download ftjob-… [-o adapter.zip] [--checkpoint ftckpt_…]
    kiln keys list|create [--name N]|revoke key_…
    kiln validate train.jsonl [--images images.zip]   (local: no server needed)

Server and key from --base-url/--api-key or KILN_BASE_URL/KILN_API_KEY. ``--json`` prints
one JSON document per line instead of text (``--watch`` adds a line per event). Exit status: 0 ok,
1 job failed or cancelled, 2 error.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kiln.client import Client
from kiln.errors import APIStatusError, KilnError


def _ts(t: int | None) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _dump(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_dump(o) for o in obj]
    return obj.model_dump() if hasattr(obj, "model_dump") else obj


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url")
    p.add_argument("--api-key")
    p.add_argument("--json", action="store_true", help="print JSON")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("upload", help="upload a dataset (.jsonl) or an archive (.zip)")
    up.add_argument("path")
    up.add_argument("--purpose", default="fine-tune")
    cr = sub.add_parser("create", help="start a fine-tuning job")
    cr.add_argument("--model", required=True)
    cr.add_argument("--training-file", required=True)
    cr.add_argument("--validation-file")
    cr.add_argument("--images-file")
    cr.add_argument("--epochs", type=int)
    cr.add_argument("--batch-size", type=int)
    cr.add_argument("--lr-multiplier", type=float)
    cr.add_argument("--lora-rank", type=int)
    cr.add_argument("--lora-alpha", type=float)
    cr.add_argument("--suffix")
    cr.add_argument("--seed", type=int)
    cr.add_argument("--watch", action="store_true", help="follow the job until it ends")
    sub.add_parser("jobs", help="list jobs")
    for name, helptext in (
        ("get", "show a job"),
        ("watch", "follow a job live until it ends"),
        ("cancel", "cancel a job"),
    ):
        sp = sub.add_parser(name, help=helptext)
        sp.add_argument("job_id")
    lg = sub.add_parser("logs", help="a job's events, oldest first")
    lg.add_argument("job_id")
    lg.add_argument("--follow", action="store_true")
    dl = sub.add_parser("download", help="download the LoRA adapter zip")
    dl.add_argument("job_id")
    dl.add_argument("-o", "--output")
    dl.add_argument("--checkpoint")
    ck = sub.add_parser("checkpoints", help="list a job's checkpoints")
    ck.add_argument("job_id")
    keys = sub.add_parser("keys", help="your API keys")
    ksub = keys.add_subparsers(dest="keys_cmd", required=True)
    ksub.add_parser("list")
    kc = ksub.add_parser("create")
    kc.add_argument("--name", default="")
    kr = ksub.add_parser("revoke")
    kr.add_argument("key_id")
    va = sub.add_parser("validate", help="check a dataset locally, line by line")
    va.add_argument("path")
    va.add_argument("--images", help="zip of the images the JSONL names")
    return p


class Out:
    def __init__(self, as_json: bool):
        self.as_json = as_json

    def __call__(self, obj: Any, text: str) -> None:
        print(json.dumps(_dump(obj), default=str) if self.as_json else text, flush=True)


def _event_line(ev) -> str:
    return f"{_ts(ev.created_at)}  {ev.level:5}  {ev.message}"


def _validate(args, out: Out) -> int:
    from kiln.dataset import DatasetError, DatasetSource, validate

    try:
        source = DatasetSource(Path(args.path), Path(args.images) if args.images else None)
    except DatasetError as e:
        out({"ok": False, "issues": [vars(i) for i in e.issues]}, str(e))
        return 1
    has_images = args.images or source.jsonl_member
    report = validate(
        source.lines(),
        (lambda r: None if source.has_image(r) else source.missing_image_message(r)) if has_images else None,
    )
    source.close()
    text = "\n".join(str(i) for i in report.issues) or f"ok: {report.stats()}"
    out({"ok": report.ok, "stats": report.stats(), "issues": [vars(i) for i in report.issues]}, text)
    return 0 if report.ok else 1


def run(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Out(args.json)
    if args.cmd == "validate":
        return _validate(args, out)
    with Client(args.base_url, args.api_key) as c:
        if args.cmd == "upload":
            f = c.files.upload(args.path, args.purpose, progress=not args.json and sys.stderr.isatty())
            out(f, f"{f.id}  {f.filename}  {f.bytes} bytes  {f.stats}")
        elif args.cmd == "create":
            hp = {
                k: v
                for k, v in (
                    ("n_epochs", args.epochs),
                    ("batch_size", args.batch_size),
                    ("learning_rate_multiplier", args.lr_multiplier),
                )
                if v is not None
            }
            lora = {k: v for k, v in (("rank", args.lora_rank), ("alpha", args.lora_alpha)) if v is not None}
            job = c.jobs.create(
                args.model,
                args.training_file,
                validation_file=args.validation_file,
                images_file=args.images_file,
                hyperparameters=hp or None,
                lora=lora or None,
                suffix=args.suffix,
                seed=args.seed,
            )
            out(job, f"{job.id}  {job.status}")
            if args.watch:
                return _watch(c, job.id, out)
        elif args.cmd == "jobs":
            jobs = list(c.jobs.list())
            out(
                jobs,
                "\n".join(
                    f"{j.id}  {j.status:16} {j.model}  {_ts(j.created_at)}  {j.fine_tuned_model or ''}" for j in jobs
                )
                or "no jobs",
            )
        elif args.cmd == "get":
            j = c.jobs.get(args.job_id)
            out(j, json.dumps(j.model_dump(), indent=2, default=str))
        elif args.cmd == "watch":
            return _watch(c, args.job_id, out)
        elif args.cmd == "cancel":
            j = c.jobs.cancel(args.job_id)
            out(j, f"{j.id}  {j.status}  (cancel requested)")
        elif args.cmd == "logs":
            events = c.jobs.events(args.job_id)
            for ev in events:
                out(ev, _event_line(ev))
            if args.follow and not c.jobs.get(args.job_id).done:
                last = events[-1].id if events else None
                seen = {e.id for e in events}
                for ev in c.jobs.stream(args.job_id):
                    if ev.id not in seen and ev.id != last:
                        out(ev, _event_line(ev))
        elif args.cmd == "download":
            path = c.adapters.download(args.job_id, args.output, checkpoint=args.checkpoint)
            out({"path": str(path), "bytes": path.stat().st_size}, f"saved {path} ({path.stat().st_size} bytes)")
        elif args.cmd == "checkpoints":
            cks = c.jobs.checkpoints(args.job_id)
            out(cks, "\n".join(f"{k.id}  step {k.step_number}  {k.metrics}" for k in cks) or "no checkpoints")
        elif args.cmd == "keys":
            if args.keys_cmd == "list":
                ks = c.keys.list()
                out(
                    ks,
                    "\n".join(f"{k.id}  {k.prefix}…  {'revoked' if k.revoked_at else 'active'}  {k.name}" for k in ks),
                )
            elif args.keys_cmd == "create":
                k = c.keys.create(args.name)
                out(k, f"{k.secret}\n(id {k.id}; the key is shown only now)")
            else:
                k = c.keys.revoke(args.key_id)
                out(k, f"revoked {k.id}")
    return 0


def _watch(c: Client, job_id: str, out: Out) -> int:
    if out.as_json:
        job = c.jobs.wait(job_id, on_event=lambda ev: out(ev, ""))
    else:
        job = c.jobs.wait(
            job_id,
            progress=sys.stderr.isatty(),
            on_event=None if sys.stderr.isatty() else lambda ev: print(_event_line(ev), flush=True),
        )
    out(job, f"{job.id}  {job.status}  {job.fine_tuned_model or (job.error.message if job.error else '')}")
    return 0 if job.status == "succeeded" else 1


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except APIStatusError as e:
        print(f"error: {e.message}", file=sys.stderr)
        for issue in e.issues[:20]:
            print(f"  line {issue['line']}: {issue['field']}: {issue['message']}", file=sys.stderr)
        return 2
    except (KilnError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
