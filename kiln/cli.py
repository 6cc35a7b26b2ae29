"""``kiln``: the command line over the SDK.

    kiln upload train.jsonl                 kiln create --model kiln-tiny --training-file file-… --watch
    kiln jobs                               kiln watch ftjob-…          kiln logs ftjob-… [--follow]
    kiln cancel ftjob-…                     kiln pause ftjob-…          kiln resume ftjob-…
    kiln checkpoints ftjob-…                kiln download ftjob-… [-o adapter.zip] [--checkpoint ftckpt_…]
    kiln export ft:… [-o merged.zip] [--no-wait]   (the adapter merged into the base, made on a worker)
    kiln chat ft:… "What is 11 + 7?" [--system S] [--max-tokens N] [--temperature T] [--seed N]
    kiln keys list|create [--name N]|revoke key_…
    kiln validate train.jsonl [--images images.zip]   (local: no server needed)

    kiln create --model kiln-tiny --training-file file-… --images-file file-… \\
        --hyperparameter max_steps=5 --hyperparameter 'memory={"recompute": "full"}' \\
        --lora-rank 16 --lora-target-modules q_proj,v_proj --metadata team=vision

Server and key from --base-url/--api-key or KILN_BASE_URL/KILN_API_KEY. ``--json`` prints JSON
Lines, one object a line, instead of text (``--watch`` adds a line per event). These three go
before or after the subcommand. ``kiln COMMAND --help`` describes each command's options. Exit
status: 0 ok, 1 job failed or cancelled (or an export failed, or ``validate`` found problems), 2 error.
"""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kiln.client import Client
from kiln.errors import APIStatusError, KilnError
from kiln.types import Job


def _ts(t: int | None) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _dump(obj: Any) -> Any:
    return obj.model_dump() if hasattr(obj, "model_dump") else obj


def _fields(values: dict[str, Any], skip: tuple[str, ...] = ()) -> str:
    """``key value`` pairs of a stats or metrics mapping for text output; nested values are left
    to --json."""
    out = []
    for k, v in values.items():
        if k in skip or isinstance(v, (dict, list)):
            continue
        out.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    return "  ".join(out)


def _common(defaults: bool) -> argparse.ArgumentParser:
    """--base-url, --api-key and --json. The main parser gives their defaults; each subcommand
    takes them too, with no defaults (SUPPRESS), so a value given after the subcommand wins and
    one given before it is not reset."""
    p = argparse.ArgumentParser(add_help=False)
    unset: dict[str, Any] = {} if defaults else {"default": argparse.SUPPRESS}
    p.add_argument("--base-url", help="the API's address (default: KILN_BASE_URL or http://127.0.0.1:8000)", **unset)
    p.add_argument("--api-key", help="your API key (default: KILN_API_KEY)", **unset)
    p.add_argument("--json", action="store_true", help="print JSON Lines: one JSON object a line", **unset)
    return p


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kiln",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[_common(defaults=True)],
    )
    common = _common(defaults=False)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(parent: Any, name: str, helptext: str) -> argparse.ArgumentParser:
        return parent.add_parser(name, help=helptext, description=helptext, parents=[common])

    up = command(sub, "upload", "upload a dataset (.jsonl), a zip of a dataset and its images, or a zip of images")
    up.add_argument("path", help="the file to upload")
    up.add_argument("--purpose", default="fine-tune", help="the file's purpose (default: fine-tune)")

    cr = command(sub, "create", "start a fine-tuning job")
    cr.add_argument("--model", required=True, help="the base model, e.g. kiln-tiny (GET /v1/models lists them)")
    cr.add_argument("--training-file", required=True, help="the training dataset's file id (file-…)")
    cr.add_argument("--validation-file", help="a validation dataset's file id")
    cr.add_argument("--images-file", help="the file id of a zip of the images the datasets name")
    cr.add_argument("--epochs", type=int, help="hyperparameter n_epochs (default: auto)")
    cr.add_argument("--batch-size", type=int, help="hyperparameter batch_size (default: auto)")
    cr.add_argument("--lr-multiplier", type=float, help="hyperparameter learning_rate_multiplier (default: auto)")
    cr.add_argument(
        "--hyperparameter",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any hyperparameter, repeatable; VALUE is JSON when it parses as JSON, else a string: "
        'max_steps=5, warmup_ratio=0.1, memory=\'{"recompute": "full"}\'',
    )
    cr.add_argument("--lora-rank", type=int, help="LoRA rank (default 8)")
    cr.add_argument("--lora-alpha", type=float, help="LoRA alpha (default 16)")
    cr.add_argument("--lora-dropout", type=float, help="LoRA dropout (default 0)")
    cr.add_argument(
        "--lora-target-modules",
        metavar="A,B,…",
        help="comma-separated modules LoRA adapts, e.g. q_proj,v_proj (default: the model's)",
    )
    cr.add_argument(
        "--lora-target-parameters",
        metavar="A,B,…",
        help="comma-separated grouped expert weights LoRA adapts, e.g. mlp.experts.gate_up_proj",
    )
    cr.add_argument("--suffix", help="a label in the fine-tuned model's name")
    cr.add_argument("--seed", type=int, help="the random seed (default: the server's)")
    cr.add_argument(
        "--metadata",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a string kept with the job, repeatable",
    )
    cr.add_argument("--watch", action="store_true", help="follow the job until it ends")

    command(sub, "jobs", "list jobs, newest first")
    for name, helptext in (
        ("get", "show a job"),
        ("watch", "follow a job live until it ends"),
        ("cancel", "cancel a job"),
        ("pause", "pause a job (kiln resume continues it)"),
        ("resume", "resume a paused job"),
        ("checkpoints", "list a job's checkpoints"),
    ):
        command(sub, name, helptext).add_argument("job_id", help="the job's id (ftjob-…)")
    lg = command(sub, "logs", "a job's events, oldest first")
    lg.add_argument("job_id", help="the job's id (ftjob-…)")
    lg.add_argument("--follow", action="store_true", help="keep printing events until the job ends")
    dl = command(sub, "download", "download the LoRA adapter zip")
    dl.add_argument("job_id", help="the job's id (ftjob-…)")
    dl.add_argument("-o", "--output", help="where to save it (default: JOB_ID.zip, or JOB_ID-CHECKPOINT.zip)")
    dl.add_argument("--checkpoint", help="a checkpoint's id (ftckpt_…) instead of the final adapter")

    ex = command(sub, "export", "merge a fine-tuned model's adapter into its base (on a worker) and download the zip")
    ex.add_argument("model", help="the fine-tuned model (ft:…; kiln jobs shows it)")
    ex.add_argument("-o", "--output", help="where to save it (default: MODEL-merged.zip, odd characters as _)")
    ex.add_argument("--no-wait", action="store_true", help="start the export and print its state; download later")

    ch = command(sub, "chat", "ask a base or fine-tuned model; the answer is printed as it is decided")
    ch.add_argument("model", help="a base model (kiln-tiny) or a fine-tuned one (ft:…), or a checkpoint's")
    ch.add_argument("message", help="the user's message")
    ch.add_argument("--system", help="a system message before it")
    ch.add_argument("--max-tokens", type=int, help="the longest answer in tokens")
    ch.add_argument("--temperature", type=float, help="0 for the most likely tokens (default 1)")
    ch.add_argument("--seed", type=int, help="the same seed gives the same answer")

    keys = command(sub, "keys", "your API keys")
    ksub = keys.add_subparsers(dest="keys_cmd", required=True, metavar="ACTION")
    command(ksub, "list", "list your keys")
    kc = command(ksub, "create", "create a key and print it (shown only once)")
    kc.add_argument("--name", default="", help="a label for the key")
    kr = command(ksub, "revoke", "revoke a key")
    kr.add_argument("key_id", help="the key's id (key_…)")

    va = command(sub, "validate", "check a dataset locally, line by line, images included (no server)")
    va.add_argument("path", help="the dataset: a .jsonl, or a zip holding it and its images")
    va.add_argument("--images", metavar="ZIP", help="zip of the images the JSONL names")
    return p


class Out:
    def __init__(self, as_json: bool):
        self.as_json = as_json

    def __call__(self, obj: Any, text: str) -> None:
        """``text``, or with --json one line per object (a list gives one line per item)."""
        if self.as_json:
            for o in obj if isinstance(obj, list) else [obj]:
                print(json.dumps(_dump(o), default=str), flush=True)
        else:
            print(text, flush=True)


def _event_line(ev) -> str:
    return f"{_ts(ev.created_at)}  {ev.level:5}  {ev.message}"


def _key_values(items: list[str], option: str, parse_json: bool) -> dict[str, Any]:
    """``KEY=VALUE`` options into a mapping; with ``parse_json`` a value that parses as JSON is
    that JSON (``5``, ``0.1``, ``true``, ``{"recompute": "full"}``), else the string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{option} {item!r}: expected KEY=VALUE")
        if key in out:
            raise ValueError(f"{option} {key} is given twice")
        if parse_json:
            try:
                out[key] = json.loads(value)
            except ValueError:
                out[key] = value
        else:
            out[key] = value
    return out


def _names(value: str | None) -> list[str] | None:
    return [n.strip() for n in value.split(",") if n.strip()] if value is not None else None


def _job_body(args) -> dict[str, Any]:
    """client.jobs.create's keyword arguments from ``kiln create``'s options."""
    hp = _key_values(args.hyperparameter, "--hyperparameter", parse_json=True)
    for key, flag, value in (
        ("n_epochs", "--epochs", args.epochs),
        ("batch_size", "--batch-size", args.batch_size),
        ("learning_rate_multiplier", "--lr-multiplier", args.lr_multiplier),
    ):
        if value is None:
            continue
        if key in hp:
            raise ValueError(f"{flag} and --hyperparameter {key}=… both set {key}: give one")
        hp[key] = value
    lora = {
        k: v
        for k, v in (
            ("rank", args.lora_rank),
            ("alpha", args.lora_alpha),
            ("dropout", args.lora_dropout),
            ("target_modules", _names(args.lora_target_modules)),
            ("target_parameters", _names(args.lora_target_parameters)),
        )
        if v is not None
    }
    return {
        "validation_file": args.validation_file,
        "images_file": args.images_file,
        "hyperparameters": hp or None,
        "lora": lora or None,
        "suffix": args.suffix,
        "seed": args.seed,
        "metadata": _key_values(args.metadata, "--metadata", parse_json=False) or None,
    }


def _validate(args, out: Out) -> int:
    from kiln.dataset import DatasetError, DatasetSource, validate

    try:
        source = DatasetSource(Path(args.path), Path(args.images) if args.images else None)
    except DatasetError as e:
        out({"ok": False, "issues": [vars(i) for i in e.issues]}, str(e))
        return 1
    except zipfile.BadZipFile as e:
        raise ValueError(f"{args.images or args.path}: {e}") from e
    in_zip = source.jsonl_member is not None
    if args.images:
        where = f"{args.images}" + (f" or {args.path}" if in_zip else "")
        missing = f"not found in {where}"
    elif in_zip:
        missing = (
            f"not found in {args.path} (paths are relative to its {source.jsonl_member}); "
            "pass a zip of the other images with --images ZIP"
        )
    else:
        missing = (
            "not found: pass the zip of the images with --images ZIP, "
            "or validate one zip holding the JSONL and its images"
        )
    try:
        report = validate(source.lines(), lambda ref: None if source.has_image(ref) else f"image {ref!r} {missing}")
    finally:
        source.close()
    lines = [str(i) for i in report.issues]
    if report.truncated:
        lines.append(f"(more problems not shown: the first {len(report.issues)} are)")
    text = "\n".join(lines) or f"ok: {_fields(report.stats())}"
    out(
        {
            "ok": report.ok,
            "stats": report.stats(),
            "issues": [vars(i) for i in report.issues],
            "truncated": report.truncated,
        },
        text,
    )
    return 0 if report.ok else 1


def run(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Out(args.json)
    if args.cmd == "validate":
        return _validate(args, out)
    with Client(args.base_url, args.api_key) as c:
        if args.cmd == "upload":
            f = c.files.upload(args.path, args.purpose, progress=not args.json and sys.stderr.isatty())
            stats = _fields(f.stats) if f.stats.get("examples") else ""
            out(f, f"{f.id}  {f.filename}  {f.bytes} bytes  {stats}".rstrip())
        elif args.cmd == "create":
            job = c.jobs.create(args.model, args.training_file, **_job_body(args))
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
        elif args.cmd in ("pause", "resume"):
            j = Job(**c.request("POST", f"/v1/fine_tuning/jobs/{args.job_id}/{args.cmd}").json())
            out(j, f"{j.id}  {j.status}  ({args.cmd} requested)")
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
        elif args.cmd == "export":
            return _export(c, args, out)
        elif args.cmd == "checkpoints":
            cks = c.jobs.checkpoints(args.job_id)
            out(
                cks,
                "\n".join(
                    f"{k.id}  step {k.step_number}  {_ts(k.created_at)}  {_fields(k.metrics, skip=('step',))}".rstrip()
                    for k in cks
                )
                or "no checkpoints",
            )
        elif args.cmd == "chat":
            return _chat(c, args, out)
        elif args.cmd == "keys":
            if args.keys_cmd == "list":
                ks = c.keys.list()
                out(
                    ks,
                    "\n".join(f"{k.id}  {k.prefix}…  {'revoked' if k.revoked_at else 'active'}  {k.name}" for k in ks)
                    or "no keys",
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


def _chat(c: Client, args, out: Out) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.message})
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    params = {k: v for k, v in params.items() if v is not None}
    if out.as_json:
        answer = c.chat.completions.create(args.model, messages, **params)
        out(answer, "")
        return 0
    for chunk in c.chat.completions.stream(args.model, messages, **params):
        for choice in chunk.choices:
            print(choice.delta.content or "", end="", flush=True)
    print()
    return 0


def _export(c: Client, args, out: Out) -> int:
    export = c.exports.create(args.model) if args.no_wait else c.exports.wait(args.model)
    if export.status == "failed":
        out(export, f"{export.id}  failed  {export.error.message if export.error else ''}".rstrip())
        return 1
    if args.no_wait:
        out(export, f"{export.id}  {export.status}  (kiln export {args.model} waits for it and downloads it)")
        return 0
    path = c.exports.download(args.model, args.output)
    size = path.stat().st_size
    out(
        {**export.model_dump(), "path": str(path)},
        f"saved {path} ({size} bytes): {export.model_type} model, {'/'.join(export.dtypes)}",
    )
    return 0


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
