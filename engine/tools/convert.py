"""Checkpoint conversion tools, streaming (one tensor, or one slice of one, in memory at a time
per worker) and parallel:

    python -m engine.tools.convert bf16 SRC DST [--workers 8]
        MXFP4 -> BF16: every ``<name>.weight_packed`` + ``<name>.weight_scale`` pair becomes
        ``<name>.weight`` (other tensors are copied), one output shard per input shard, one
        process per shard at a time; a few rows of every tensor are checked against the
        bit-level reference decode (``--verify-rows``).
    python -m engine.tools.convert dcp SRC DST --fsdp-shards 128 --ep-size 64 [--workers 8]
        safetensors (plain or MXFP4, any supported family's names) -> a DCP checkpoint under
        the module tree's names, each tensor cut exactly as a run with that many FSDP shards and
        that EP size holds it (dim 0 in FSDP2's chunks; expert tensors first into ``ep`` expert
        groups, then each into fsdp/ep chunks), so every rank reads only its own pieces. DCP
        reshards on load, so any other layout loads it too.

The module tree's names come from the model the config describes, built on the meta device; each
module tensor is found on disk under its own name or the family's (``engine.model.common.names``:
``block_sparse_moe``, Kimi's ``w1/w3/w2`` or DeepSeek's ``gate/up/down_proj`` per expert, the
q/k/v short convolutions).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import re
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.checkpoint.mxfp4 import PACKED, SCALE, decode_reference, dequantize
from engine.model.common import names
from engine.model.common.hf import shards

_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I64": torch.int64,
    "I32": torch.int32,
    "BOOL": torch.bool,
}


class Checkpoint:
    """A safetensors folder (one file or an index): which file holds each key, and reads of
    whole tensors or of rows [a, b) of dim 0, MXFP4 pairs decoded on the way."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.files: dict[str, Path] = {}
        for path in shards(self.folder):
            with safe_open(str(path), framework="pt") as f:
                self.files.update(dict.fromkeys(f.keys(), path))

    def has(self, key: str) -> bool:
        return key in self.files or self._packed(key) in self.files

    @staticmethod
    def _packed(key: str) -> str:
        return key.removesuffix(".weight") + PACKED

    def _raw(self, key: str, a: int | None = None, b: int | None = None) -> torch.Tensor:
        with safe_open(str(self.files[key]), framework="pt") as f:
            return f.get_tensor(key) if a is None else f.get_slice(key)[a:b]

    def rows(self, key: str, a: int | None = None, b: int | None = None) -> torch.Tensor:
        if key in self.files:
            return self._raw(key, a, b)
        base = key.removesuffix(".weight")
        return dequantize(self._raw(base + PACKED, a, b), self._raw(base + SCALE, a, b))

    def dtype(self, key: str) -> torch.dtype:
        if key not in self.files:
            return torch.bfloat16  # what MXFP4 decodes to
        with safe_open(str(self.files[key]), framework="pt") as f:
            return _DTYPES[f.get_slice(key).get_dtype()]


# ---- MXFP4 -> BF16 -------------------------------------------------------------------------


def _convert_shard(src: str, file: str, dst: str, verify_rows: int) -> dict[str, str]:
    """One input shard into one output shard of the same name. Returns its weight map."""
    torch.set_num_threads(1)
    ckpt = Checkpoint(Path(src))
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(Path(src) / file), framework="pt") as f:
        keys = list(f.keys())
    for key in keys:
        if key.endswith(SCALE) and key.removesuffix(SCALE) + PACKED in ckpt.files:
            continue  # decoded with its packed half
        if key.endswith(PACKED):
            base = key.removesuffix(PACKED)
            if base + SCALE not in ckpt.files:
                raise ValueError(f"{key} has no {base + SCALE}")
            packed, scale = ckpt._raw(key), ckpt._raw(base + SCALE)
            w = dequantize(packed, scale)
            n = min(verify_rows, packed.shape[0])
            if n and not torch.equal(
                w[:n].double(), decode_reference(packed[:n], scale[:n]).to(torch.bfloat16).double()
            ):
                raise RuntimeError(f"{key}: the decode disagrees with the reference")
            out[base + ".weight"] = w
        else:
            out[key] = ckpt._raw(key)
    save_file(out, str(Path(dst) / file), metadata={"format": "pt"})
    return {k: file for k in out}


def to_bf16(src: Path, dst: Path, workers: int = 8, verify_rows: int = 2) -> None:
    ckpt = Checkpoint(src)
    dst.mkdir(parents=True, exist_ok=True)
    files = sorted({p.name for p in ckpt.files.values()})
    weight_map: dict[str, str] = {}
    ctx = multiprocessing.get_context("spawn")  # no forked torch threads
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(files))), mp_context=ctx) as pool:
        for part in pool.map(
            _convert_shard, [str(src)] * len(files), files, [str(dst)] * len(files), [verify_rows] * len(files)
        ):
            weight_map.update(part)
    _copy_side_files(src, dst)
    if len(files) > 1 or (src / "model.safetensors.index.json").exists():
        (dst / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
        )


def _copy_side_files(src: Path, dst: Path) -> None:
    """config.json without its quantization_config, and every other non-weight file as is."""
    for p in src.iterdir():
        if p.suffix == ".safetensors" or p.name == "model.safetensors.index.json" or not p.is_file():
            continue
        if p.name == "config.json":
            cfg = json.loads(p.read_text())
            cfg.pop("quantization_config", None)
            (dst / p.name).write_text(json.dumps(cfg, indent=2))
        else:
            shutil.copy2(p, dst / p.name)


# ---- safetensors -> DCP ----------------------------------------------------------------------


@dataclass
class _Source:
    """Where a module tensor's rows come from: one disk tensor, per-expert disk tensors stacked
    (each expert's parts joined on dim 0: gate rows then up rows), or parts joined on dim 0."""

    ckpt: Checkpoint
    keys: list[list[str]]  # stack: one list per expert; direct/concat: one list
    stacked: bool

    def rows(self, a: int, b: int) -> torch.Tensor:
        if self.stacked:
            return torch.stack([torch.cat([self.ckpt.rows(k) for k in parts]) for parts in self.keys[a:b]])
        if len(self.keys[0]) == 1:
            return self.ckpt.rows(self.keys[0][0], a, b)
        return torch.cat([self.ckpt.rows(k) for k in self.keys[0]])[a:b]

    @property
    def dtype(self) -> torch.dtype:
        return self.ckpt.dtype(self.keys[0][0])


def find_source(ckpt: Checkpoint, fqn: str, experts: int) -> _Source:
    for name in names.disk_names(fqn):
        if ckpt.has(name):
            return _Source(ckpt, [[name]], False)
    if m := re.match(r"^(.*\.experts)\.(gate_up_proj|down_proj)$", fqn):
        for prefix in names.disk_names(m.group(1)):
            for parts in names.EXPERT_PARTS[m.group(2)]:
                keys = [[f"{prefix}.{e}.{p}.weight" for p in parts] for e in range(experts)]
                if all(ckpt.has(k) for k in keys[0]):
                    missing = [k for ks in keys for k in ks if not ckpt.has(k)]
                    if missing:
                        raise ValueError(f"{ckpt.folder}: lacks {missing[:3]}")
                    return _Source(ckpt, keys, True)
    if m := re.match(r"^(.*\.self_attn)\.conv1d\.weight$", fqn):
        for prefix in names.disk_names(m.group(1)):
            conv = [f"{prefix}.{p}_conv1d.weight" for p in names.CONV_PARTS]
            if all(ckpt.has(k) for k in conv):
                return _Source(ckpt, [conv], False)
    raise ValueError(f"{ckpt.folder}: no tensor on disk for {fqn} (tried {', '.join(names.disk_names(fqn)[:4])}, ...)")


def _chunks(n: int, parts: int, start: int = 0) -> list[tuple[int, int]]:
    """[a, b) row ranges of ``n`` rows cut in ``parts`` as torch.chunk (and FSDP2, DTensor) cut:
    ceil(n / parts) each, the last ones shorter or empty (empty ones left out)."""
    step = math.ceil(n / parts) if n else 0
    return [(start + a, start + min(a + step, n)) for a in range(0, n, step or 1)][:parts] if n else []


def layout(fqn: str, shape: tuple[int, ...], expert: bool, fsdp: int, ep: int) -> list[tuple[int, int]]:
    """The dim-0 row ranges of a tensor's shards in a run of ``fsdp`` ranks and EP size ``ep``."""
    if not shape:
        return [(0, 0)]
    if not expert or ep == 1:
        return _chunks(shape[0], fsdp)
    per = shape[0] // ep
    return [c for g in range(ep) for c in _chunks(per, fsdp // ep, g * per)]


class _Planned:
    """A tensor that exists only as a plan: its shards' places for DCP, its rows read on demand."""

    def __init__(self, shape: tuple[int, ...], ranges: list[tuple[int, int]], source: _Source):
        self.shape, self.ranges, self.source = shape, ranges, source

    def __create_write_items__(self, fqn: str, obj: object) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        dtype = self.source.dtype
        items = []
        for a, b in self.ranges:
            offsets = torch.Size([a] + [0] * (len(self.shape) - 1)) if self.shape else torch.Size([])
            sizes = torch.Size([b - a, *self.shape[1:]]) if self.shape else torch.Size([])
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets, sizes),
                        properties=TensorProperties(dtype=dtype),
                        size=torch.Size(self.shape),
                    ),
                )
            )
        return items

    def read(self, offset: torch.Size) -> torch.Tensor:
        if not self.shape:
            return self.source.ckpt.rows(self.source.keys[0][0])
        a = offset[0] if len(offset) else 0
        b = next(b for a_, b in self.ranges if a_ == a)
        return self.source.rows(a, b).contiguous()


def to_dcp(src: Path, dst: Path, fsdp_shards: int, ep_size: int = 1, workers: int = 8) -> dict[str, int]:
    """Returns counts: tensors and shards written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from engine.model.common.moe import Experts
    from engine.model.registry import build_meta

    if fsdp_shards < 1 or ep_size < 1 or fsdp_shards % ep_size:
        raise ValueError(f"--ep-size ({ep_size}) must divide --fsdp-shards ({fsdp_shards})")
    model = build_meta(src)
    ckpt = Checkpoint(src)
    expert_params: dict[str, int] = {}
    for path, m in model.named_modules():
        if isinstance(m, Experts):
            E = m.gate_up_proj.shape[0]
            if E % ep_size:
                raise ValueError(f"--ep-size {ep_size} does not divide the {E} experts of {path}")
            expert_params.update({f"{path}.{n}": E for n, _ in m.named_parameters()})
    state: dict[str, _Planned] = {}
    for fqn, p in model.named_parameters():
        shape = tuple(p.shape)
        source = find_source(ckpt, fqn, expert_params.get(fqn, 0))
        state[f"model.{fqn}"] = _Planned(shape, layout(fqn, shape, fqn in expert_params, fsdp_shards, ep_size), source)
    for name, _ in model.named_buffers():  # persistent buffers (the routers' biases): whole, once
        if name in model.state_dict():
            source = find_source(ckpt, name, 0)
            state[f"buffers.{name}"] = _Planned(
                tuple(model.get_buffer(name).shape), [(0, model.get_buffer(name).shape[0])], source
            )

    class Planner(DefaultSavePlanner):
        def lookup_object(self, index):
            return self.state_dict[index.fqn].read(index.offset)

    dcp.save(
        state, storage_writer=FileSystemWriter(str(dst), thread_count=max(1, workers)), planner=Planner(), no_dist=True
    )
    _copy_side_files(src, dst)
    return {"tensors": len(state), "shards": sum(len(p.ranges) for p in state.values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.tools.convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bf16", help="MXFP4 safetensors -> BF16 safetensors")
    d = sub.add_parser("dcp", help="safetensors -> DCP laid out for FSDP shards and an EP size")
    for s in (b, d):
        s.add_argument("src", type=Path)
        s.add_argument("dst", type=Path)
        s.add_argument("--workers", type=int, default=8)
    b.add_argument("--verify-rows", type=int, default=2, help="rows per tensor checked against the reference decode")
    d.add_argument("--fsdp-shards", type=int, required=True)
    d.add_argument("--ep-size", type=int, default=1)
    a = p.parse_args(argv)
    try:
        if a.cmd == "bf16":
            to_bf16(a.src, a.dst, a.workers, a.verify_rows)
        else:
            counts = to_dcp(a.src, a.dst, a.fsdp_shards, a.ep_size, a.workers)
            print(f"{counts['tensors']} tensors in {counts['shards']} shards -> {a.dst}")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
