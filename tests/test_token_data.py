"""Token files (``zorse prepare-data``) and ``TokenData``: real text (gensim's
Lee corpus), real tokenizers (bytes, SmolLM2's from the GGUF file saved with
save_pretrained, a ``tokenizers`` WordLevel vocabulary above 65536), real
``datasets`` files; batches equal ``data.global_batch``; each bad input gives
a message naming the file, the field, the value and the fix."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import CLUSTERS, fixed_plan, gpt3x64, reference_step, spawn_ranks, tiny_llama_tied
from zorse_fx.cli import main as zorse_main
from zorse_fx.data import global_batch, read_corpus, tokenize
from zorse_fx.errors import DataError
from zorse_fx.token_data import (FILL_ID, TokenData, load_tokenizer, model_vocab_size, plan_rank_samples,
                                 prepare_data, rank_samples)

LM = dict(input_names=("input_ids", "labels"))


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """``datasets`` / Hugging Face caches in a temporary directory."""
    import datasets

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")


@pytest.fixture(scope="module")
def lee_docs() -> list[str]:
    """The Lee corpus's 300 articles (one per line)."""
    return [line for line in read_corpus("lee").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    """SmolLM2's tokenizer (from the GGUF file) saved with save_pretrained."""
    d = tmp_path_factory.mktemp("smollm2_tokenizer")
    load_tokenizer("smollm2-135m").hf.save_pretrained(d)
    return d


def _ids(data: TokenData) -> list[int]:
    return np.asarray(data.tokens).astype(np.int64).tolist()


def test_text_file_with_bytes_equals_tokenize(tmp_path):
    text = read_corpus("lee")
    (tmp_path / "lee.txt").write_text(text, encoding="utf-8")
    header = prepare_data(str(tmp_path / "lee.txt"), tmp_path / "out" / "lee", tokenizer="bytes")
    data = TokenData.open(tmp_path / "out" / "lee.bin")
    assert data.tokens.dtype == np.uint16 and isinstance(data.tokens, np.memmap) and data.tokens.mode == "r"
    assert torch.equal(torch.from_numpy(data.tokens.astype(np.int64)), tokenize(text))  # one document, no EOS
    assert header == json.loads((tmp_path / "out" / "lee.json").read_text())
    assert {k: header[k] for k in ("format", "version", "dtype", "vocab_size", "tokenizer", "eos_id",
                                   "num_documents", "num_tokens")} == {
        "format": "zorse_fx.tokens", "version": 1, "dtype": "uint16", "vocab_size": 256, "tokenizer": "bytes",
        "eos_id": None, "num_documents": 1, "num_tokens": len(text.encode())}
    assert header["max_token_id"] == max(text.encode()) and "lee.txt" in header["source"]
    assert TokenData.open(tmp_path / "out" / "lee.json").header == header  # either path of the pair


def test_directory_with_saved_smollm2_tokenizer(tmp_path, lee_docs, smollm2_dir):
    """Every *.txt file under the directory, sorted by path, is a document
    followed by SmolLM2's EOS; the tokenizer is loaded from its directory."""
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    files = {"b.txt": lee_docs[1], "a.txt": lee_docs[0], "sub/c.txt": lee_docs[2]}
    for name, text in files.items():
        (d / name).write_text(text, encoding="utf-8")
    (d / "notes.md").write_text("not a document")
    header = prepare_data(str(d), tmp_path / "tok", tokenizer=str(smollm2_dir))
    tok = load_tokenizer(str(smollm2_dir))
    assert tok.vocab_size == 49152 and tok.eos_id == 2
    want = []
    for name in ("a.txt", "b.txt", "sub/c.txt"):
        want += tok.hf(files[name], add_special_tokens=False)["input_ids"] + [2]
    assert _ids(TokenData.open(tmp_path / "tok.bin")) == want
    assert (header["num_documents"], header["eos_id"], header["dtype"]) == (3, 2, "uint16")
    assert header["tokenizer"] == str(smollm2_dir) and header["max_token_id"] == max(want)


def test_datasets_saved_to_disk_and_jsonl_through_the_cli(tmp_path, lee_docs, capsys):
    import datasets

    docs = lee_docs[:20]
    datasets.Dataset.from_dict({"text": docs, "n": list(range(20))}).save_to_disk(str(tmp_path / "saved"))
    prepare_data(str(tmp_path / "saved"), tmp_path / "saved_tok", tokenizer="bytes", progress=False)
    want = [b for doc in docs for b in doc.encode()]
    assert _ids(TokenData.open(tmp_path / "saved_tok.bin")) == want
    # A DatasetDict: --split picks one.
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:2]}),
                          "test": datasets.Dataset.from_dict({"text": docs[2:3]})}).save_to_disk(str(tmp_path / "dd"))
    prepare_data(str(tmp_path / "dd"), tmp_path / "dd_tok", split="test", progress=False)
    assert _ids(TokenData.open(tmp_path / "dd_tok.bin")) == list(docs[2].encode())
    with pytest.raises(DataError, match=r"splits \['test', 'train'\], not split='val'; pass --split"):
        prepare_data(str(tmp_path / "dd"), tmp_path / "x", split="val", progress=False)

    jsonl = tmp_path / "news.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": doc}) + "\n" for i, doc in enumerate(docs)))
    assert zorse_main(["prepare-data", str(jsonl), "--text-field", "body", "-o", str(tmp_path / "j")]) == 0
    out = capsys.readouterr()
    assert "[zorse] prepare-data: 20 documents, " in out.out and "tokenizing (bytes)" in out.err  # tqdm: stderr
    assert _ids(TokenData.open(tmp_path / "j.bin")) == want
    assert json.loads((tmp_path / "j.json").read_text())["num_documents"] == 20
    # The text field is named in the error, with the columns there are.
    assert zorse_main(["prepare-data", str(jsonl), "-o", str(tmp_path / "k")]) == 1
    err = capsys.readouterr().err
    assert "text_field='text'" in err and "'body'" in err and "--text-field" in err
    assert zorse_main(["prepare-data", str(tmp_path / "nope.txt"), "-o", str(tmp_path / "k")]) == 1
    assert "nope.txt" in capsys.readouterr().err


REPLACE_HINT = "convert the file to UTF-8 or leave it out, or pass --errors replace to read undecodable bytes as U+FFFD"


def test_prepare_data_non_utf8_names_offset(tmp_path, capsys):
    """Bytes that are not UTF-8 (a Latin-1 e, a binary 0xff) are refused with the
    file and the byte offset, in a text file, a directory of them and a .jsonl
    (checked before ``datasets`` reads it, whose own error has no file offset)."""
    txt = tmp_path / "latin1.txt"
    txt.write_bytes("hello\ncaf\u00e9 au lait".encode("latin-1"))
    assert zorse_main(["prepare-data", str(txt), "-o", str(tmp_path / "t")]) == 1
    assert capsys.readouterr().err == (f"zorse: {txt}: not UTF-8 text: byte 0xe9 at byte offset 9 (invalid "
                                       f"continuation byte); {REPLACE_HINT}\n")
    assert not (tmp_path / "t.bin").exists()
    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text("fine text")
    (books / "b.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(DataError, match=rf"^{books / 'b.txt'}: not UTF-8 text: byte 0x89 at byte offset 0 \(invalid "
                                        r"start byte\); convert"):
        prepare_data(str(books), tmp_path / "b", progress=False)
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_bytes(b'{"text": "hello"}\n' * 3 + b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"^{jsonl}: not UTF-8 text: byte 0xe9 at byte offset 67 \(invalid "
                                        r"continuation byte\)"):
        prepare_data(str(jsonl), tmp_path / "j", progress=False)


def test_prepare_data_errors_replace(tmp_path):
    """--errors replace reads each undecodable byte as U+FFFD (3 UTF-8 bytes in the byte tokenizer)."""
    txt = tmp_path / "latin1.txt"
    txt.write_bytes(b"caf\xe9")
    assert zorse_main(["prepare-data", str(txt), "--errors", "replace", "-o", str(tmp_path / "t")]) == 0
    assert _ids(TokenData.open(tmp_path / "t.bin")) == list("caf\ufffd".encode())
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    prepare_data(str(jsonl), tmp_path / "j", errors="replace", progress=False)
    assert _ids(TokenData.open(tmp_path / "j.bin")) == list("okcaf\ufffd".encode())


def test_prepare_data_empty_jsonl(tmp_path, capsys):
    """An empty .jsonl (was StopIteration from datasets), an empty .txt, a file of
    whitespace, and rows without the text field: each named in one line."""
    for name, what in (("empty.jsonl", "0 bytes"), ("empty.txt", "0 bytes"), ("blank.jsonl", "3 bytes of whitespace")):
        path = tmp_path / name
        path.write_text("" if "empty" in name else " \n\n")
        assert zorse_main(["prepare-data", str(path), "-o", str(tmp_path / "o")]) == 1
        assert capsys.readouterr().err == (f"zorse: data source {path} is empty ({what}): no documents to tokenize; "
                                           f"give a file with text\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"body": "x"}\n')
    assert zorse_main(["prepare-data", str(rows), "-o", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err == (f"zorse: dataset {rows} (datasets 'json' builder) has no column "
                                       f"text_field='text' (columns: ['body']); pass --text-field with the column "
                                       f"that holds the text\n")
    assert not (tmp_path / "o.bin").exists()


JSON_FIX = ("correct that line or remove it (a .jsonl file holds one JSON object per line, a .json file one JSON "
            "document)")


def _zorse_lines(err: str) -> list[str]:
    """The `zorse:` lines of stderr (tqdm's bar shares it, ended with carriage returns)."""
    return [ln for ln in err.splitlines() if ln.startswith("zorse")]


def test_prepare_data_broken_jsonl_line_named(tmp_path, capsys):
    """A .jsonl whose line 2501 is not JSON (pyarrow calls it "row 688" of
    its block, without the file): one line naming the file, the line, the
    column and json's message; no half-written .bin.tmp is left, and
    datasets' own log line of the failure is held back."""
    path = tmp_path / "late.jsonl"
    rows = [json.dumps({"text": f"document {i}"}) for i in range(3000)]
    path.write_text("\n".join([*rows[:2500], '{"text": oops}', *rows[2500:]]) + "\n")
    assert zorse_main(["prepare-data", str(path), "-o", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert _zorse_lines(err) == [f"zorse: {path}: line 2501, column 10: not JSON (Expecting value); {JSON_FIX}"]
    assert "ArrowInvalid" not in err and "Failed to load JSON" not in err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("o")) == []
    path.write_text('{"text": "one"}\n{"text": "two\n{"text": "three"}\n')  # an unterminated string
    with pytest.raises(DataError) as e:
        prepare_data(str(path), tmp_path / "o", progress=False)
    assert str(e.value) == f"{path}: line 2, column 10: not JSON (Unterminated string starting); {JSON_FIX}"


@pytest.mark.parametrize("name, content, message", [
    ("doc.json", '[{"text": "a"},\n {"text": "b"\n]\n',
     f"line 3, column 1: not JSON (Expecting ',' delimiter); {JSON_FIX}"),
    ("rows.csv", 'text,id\nhello,1\n"a,b",2,3\n', "not a CSV file the datasets 'csv' builder can read (ParserError: "
     "Error tokenizing data. C error: Expected 2 fields in line 3, saw 3); correct that row (a field holding the "
     "delimiter or a line break must be quoted)"),
    ("rows.parquet", "PAR1 not parquet", "not a Parquet file the datasets 'parquet' builder can read (ArrowInvalid: "
     "Parquet magic bytes not found in footer. Either the file is corrupted or this is not a parquet file.); write it "
     "again (pandas or pyarrow to_parquet)"),
], ids=["json", "csv", "parquet"])
def test_prepare_data_broken_source_of_each_format_named(tmp_path, capsys, name, content, message):
    """The other formats prepare-data reads through datasets: a .json
    document, a .csv row, a file that is not Parquet; each one line naming
    the file."""
    path = tmp_path / name
    path.write_text(content)
    assert zorse_main(["prepare-data", str(path), "-o", str(tmp_path / "o")]) == 1
    assert _zorse_lines(capsys.readouterr().err) == [f"zorse: {path}: {message}"]
    assert not list(tmp_path.glob("o.*"))


def test_deep_jsonl_prepare_data_refused(tmp_path, capsys):
    """A .jsonl row with 10,000 nested lists (its text field, or another one)
    and a .json document of them: one line naming the file, the line and the
    limit, before `datasets` reads it (pyarrow's JSON reader overflowed the C
    stack: the process died with SIGSEGV)."""
    deep = "[" * 10_000 + "]" * 10_000
    for name, text, line in (("rows.jsonl", '{"text": "ok"}\n{"text": "x", "meta": ' + deep + "}\n", 2),
                             ("text.jsonl", '{"text": ' + deep + "}\n", 1),
                             ("doc.json", '{"rows": [\n' + deep + "\n]}\n", 2)):
        path = tmp_path / name
        path.write_text(text)
        assert zorse_main(["prepare-data", str(path), "-o", str(tmp_path / "o")]) == 1
        assert capsys.readouterr().err == (
            f"zorse: data source {path}: values nested more than 100 levels deep (arrays or objects inside each "
            f"other) at line {line}; give one JSON object per document with its text in --text-field\n")
    assert not (tmp_path / "o.bin").exists()


def test_vocabulary_of_65536_or_more_is_stored_as_uint32(tmp_path, lee_docs):
    """A WordLevel tokenizer of 70000 words (the Lee corpus's words, then
    filler), EOS last: ids above 65535 survive the round trip."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for doc in lee_docs for w in doc.split()})
    vocab = {f"<filler{i}>": i for i in range(70000 - len(words) - 2)}
    vocab.update({w: len(vocab) + i for i, w in enumerate(words)})
    vocab["<unk>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    assert len(vocab) == 70000 and max(vocab.values()) == 69999
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path / "wl")
    (tmp_path / "a.txt").write_text(lee_docs[0])
    header = prepare_data(str(tmp_path / "a.txt"), tmp_path / "big", tokenizer=str(tmp_path / "wl"))
    assert (header["dtype"], header["vocab_size"], header["eos_id"]) == ("uint32", 70000, 69999)
    data = TokenData.open(tmp_path / "big.bin")
    assert data.tokens.dtype == np.uint32
    assert _ids(data) == [vocab[w] for w in lee_docs[0].split()] + [69999]
    assert max(_ids(data)) >= 65536 and (tmp_path / "big.bin").stat().st_size == 4 * header["num_tokens"]
    # The bytes tokenizer of the same text: uint16 (two bytes per token).
    assert prepare_data(str(tmp_path / "a.txt"), tmp_path / "small", progress=False)["dtype"] == "uint16"


@pytest.mark.parametrize("label_mode", ["same", "shifted"])
def test_batches_equal_global_batch_and_a_rank_reads_only_its_rows(tmp_path, label_mode):
    text = read_corpus("lee")
    (tmp_path / "lee.txt").write_text(text, encoding="utf-8")
    prepare_data(str(tmp_path / "lee.txt"), tmp_path / "lee", progress=False)
    data, tokens = TokenData.open(tmp_path / "lee.bin"), tokenize(text)
    kw = dict(global_batch_size=6, seq_len=32, label_mode=label_mode, **LM)
    chunks = tokens.numel() // 33
    for step in (0, 1, 7, chunks // 6 + 1):  # the last one wraps around the corpus
        full = data.global_batch(step, **kw)
        ref = global_batch(tokens, step, **kw)
        assert full.keys() == ref.keys() and all(torch.equal(full[k], ref[k]) for k in ref)
        # A rank with rows [1, 3) of each of 3 micro-batches of 2: samples 1, 3, 5.
        samples = rank_samples(2, 3, 1, 2)
        assert samples == [1, 3, 5]
        part = data.global_batch(step, samples=samples, **kw)
        for k in ref:
            assert part[k].shape == ref[k].shape and part[k].dtype == torch.int64
            assert torch.equal(part[k][samples], ref[k][samples])
            assert (part[k][[0, 2, 4]] == FILL_ID).all()
    assert rank_samples(4, 2, 0, 4) == list(range(8)) and rank_samples(4, 2, 1, 3) == [1, 2, 5, 6]
    with pytest.raises(DataError, match=r"samples \[6\] are not all in \[0, 6\)"):
        data.global_batch(0, samples=[6], **kw)


def test_validation_split_is_the_last_chunks_and_disjoint():
    seq = 9  # chunks of 10 tokens; token j of the corpus is j: a row's first token / 10 is its chunk
    data = TokenData.from_tensor(torch.arange(1000, dtype=torch.int64))
    assert data.split_chunks(seq, val_fraction=0.25) == (75, 25)
    assert data.split_chunks(seq, val_tokens=101) == (89, 11)
    kw = dict(global_batch_size=8, seq_len=seq, label_mode="shifted", val_fraction=0.25, **LM)
    train = {int(r[0]) // 10 for k in range(20) for r in data.global_batch(k, **kw)["input_ids"]}
    val = {int(r[0]) // 10 for k in range(20) for r in data.global_batch(k, split="val", **kw)["input_ids"]}
    assert train == set(range(75)) and val == set(range(75, 100))
    # Without a validation split the batches are data.global_batch's.
    plain = data.global_batch(3, **{**kw, "val_fraction": 0.0})
    ref = global_batch(torch.arange(1000), 3, global_batch_size=8, seq_len=seq, label_mode="shifted", **LM)
    assert all(torch.equal(plain[k], ref[k]) for k in ref)
    with pytest.raises(DataError, match="leaves none of its 100 chunks to train on; lower --val-fraction"):
        data.split_chunks(seq, val_tokens=1000)
    with pytest.raises(DataError, match="no validation split"):
        data.global_batch(0, split="val", **{**kw, "val_fraction": 0.0})


def test_corpus_smaller_than_a_global_batch_needs_allow_repeat(tmp_path):
    (tmp_path / "t.txt").write_text(read_corpus("lee")[:5 * 33 + 10])
    prepare_data(str(tmp_path / "t.txt"), tmp_path / "t", progress=False)
    data = TokenData.open(tmp_path / "t.bin")
    kw = dict(global_batch_size=8, seq_len=32, label_mode="same", **LM)
    with pytest.raises(DataError) as e:
        data.global_batch(0, **kw)
    msg = str(e.value)
    assert str(tmp_path / "t.bin") in msg and "5 sequences" in msg and "global batch of 8" in msg
    assert "--allow-repeat" in msg
    batch = data.global_batch(0, allow_repeat=True, **kw)  # repeats, as data.global_batch always did
    assert torch.equal(batch["input_ids"], global_batch(torch.from_numpy(data.tokens.astype(np.int64)), 0,
                                                        **kw)["input_ids"])
    with pytest.raises(DataError, match="fewer than one sequence of seq_len \\+ 1 = 1025"):
        data.global_batch(0, **{**kw, "seq_len": 1024})


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_legacy_torch_token_files_of_integer_dtypes(tmp_path, lee_bytes, dtype):
    torch.save(lee_bytes[:4000].to(dtype), tmp_path / "tokens.pt")
    data = TokenData.load(tmp_path / "tokens.pt")
    data.check_vocab(256)
    kw = dict(global_batch_size=4, seq_len=16, label_mode="shifted", **LM)
    ref = global_batch(lee_bytes[:4000], 2, **kw)
    assert all(torch.equal(data.global_batch(2, **kw)[k], ref[k]) for k in ref)


def test_bad_token_files_are_named_with_the_fix(tmp_path, lee_bytes):
    (tmp_path / "news.txt").write_text("Plain text is not a token file.\n")
    with pytest.raises(DataError, match=r"news.txt is neither a token file of `zorse prepare-data` \(.bin with its "
                                        r".json header\) nor a torch.save file of token ids \(UnpicklingError\); for "
                                        r"text, run `zorse prepare-data .*news.txt -o DATA` and pass --data DATA.json, "
                                        r"or give `zorse train` --corpus .*news.txt"):
        TokenData.load(tmp_path / "news.txt")
    torch.save(lee_bytes[:100].float(), tmp_path / "float.pt")
    with pytest.raises(DataError, match=r"float.pt: dtype is float32, token ids must be integers \(int64, int32, "
                                        r"int16, uint8\); convert it with .to\(torch.int64\)"):
        TokenData.load(tmp_path / "float.pt")
    torch.save(lee_bytes[:100].view(10, 10), tmp_path / "2d.pt")
    with pytest.raises(DataError, match=r"2d.pt: shape is \(10, 10\), token ids must be one 1-D tensor"):
        TokenData.load(tmp_path / "2d.pt")
    torch.save({"ids": lee_bytes[:10]}, tmp_path / "dict.pt")
    with pytest.raises(DataError, match="dict.pt holds a dict, not a tensor"):
        TokenData.load(tmp_path / "dict.pt")
    with pytest.raises(DataError, match="nope.pt not found"):
        TokenData.load(tmp_path / "nope.pt")
    big = lee_bytes[:100].clone()
    big[50] = 300
    torch.save(big, tmp_path / "big.pt")
    with pytest.raises(DataError, match=r"big.pt has token id 300, but the model's vocabulary is 256 \(ids must be "
                                        r"< 256\): the first such id is at token offset 50, the largest is 300; "
                                        r"prepare the data again with the model's tokenizer"):
        TokenData.load(tmp_path / "big.pt").check_vocab(256)
    big[50] = -3
    torch.save(big, tmp_path / "neg.pt")
    with pytest.raises(DataError, match=r"neg.pt has negative token id -3 at token offset 50; token ids must be in "
                                        r"\[0, 256\)"):
        TokenData.load(tmp_path / "neg.pt").check_vocab(256)


def test_bad_headers_and_vocabulary_of_token_files(tmp_path, lee_docs):
    from zorse_fx.errors import FileFormatError, TokenHeaderError

    (tmp_path / "a.txt").write_text(lee_docs[0])
    prepare_data(str(tmp_path / "a.txt"), tmp_path / "t", tokenizer="smollm2-135m", progress=False)
    data = TokenData.open(tmp_path / "t.bin")
    data.check_vocab(49152)
    hi = data.header["max_token_id"]
    with pytest.raises(DataError, match=rf"t.bin \(tokenizer 'smollm2-135m', vocabulary 49152\) has token id {hi}, "
                                        r"but the model's vocabulary is 256"):
        data.check_vocab(256)
    with pytest.warns(UserWarning, match=rf"t.bin \(tokenizer 'smollm2-135m', vocabulary 49152\): the tokenizer's "
                                         rf"vocabulary is larger than the model's \({hi + 1}\); every id in the file "
                                         rf"fits \(largest {hi}\)"):
        data.check_vocab(hi + 1)
    header = json.loads((tmp_path / "t.json").read_text())
    raw = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(raw[:-2])
    with pytest.raises(DataError, match=rf"t.bin has {len(raw) - 2:,} bytes but its header .*t.json says "
                                        rf"num_tokens={header['num_tokens']:,} of dtype uint16 \(2 B each: "
                                        rf"{len(raw):,} bytes\).*`zorse prepare-data`"):
        TokenData.open(tmp_path / "t.bin")
    (tmp_path / "t.bin").write_bytes(raw)
    fix = "; correct it or rewrite the token file with `zorse prepare-data`"
    for field, value, want in [
            ("dtype", "float32", r"t.json: field 'dtype' is 'float32'; allowed: 'uint16', 'uint32'$"),
            ("version", 9, r"t.json: token file header format version 9 is not supported by this zorse_fx \(reads "
                           r"version 1\); rewrite the token file with `zorse prepare-data`"),
            ("format", "npy", r"t.json: not a zorse_fx token file header \(field 'format' is 'npy', expected "
                              r"'zorse_fx.tokens'\)"),
            ("num_tokens", -1, rf"t.json: field 'num_tokens' is -1: expected `int` >= 1 \(token ids in the .bin "
                               rf"file\){fix}"),
            ("max_token_id", 70000, rf"t.json: field 'max_token_id' is 70000: expected <= 65535 \(the largest "
                                    rf"uint16\){fix}"),
            ("eos_id", "2", rf"t.json: field 'eos_id' is '2': expected `int \| null`, got `str` \(the id written "
                            rf"after each document, or null\){fix}"),  # wrong type
            ("vocab_size", 0, rf"t.json: field 'vocab_size' is 0: expected `int` >= 1 .*{fix}"),  # out of range
            ("max_id", 3, r"t.json: unknown field 'max_id' \(value 3\); did you mean 'max_token_id'\? remove it "
                          r"or rewrite the token file with `zorse prepare-data`")]:  # unknown field
        (tmp_path / "t.json").write_text(json.dumps({**header, field: value}))
        with pytest.raises(TokenHeaderError, match=want) as e:
            TokenData.open(tmp_path / "t.json")
        assert isinstance(e.value, DataError) and isinstance(e.value, FileFormatError)
        assert (e.value.path, e.value.field, e.value.value) == (str(tmp_path / "t.json"), repr(field), value)
    (tmp_path / "t.json").write_text("{\"format\": ")
    with pytest.raises(DataError, match=r"t.json: invalid JSON at line 1: .*; rewrite the token file with "
                                        r"`zorse prepare-data`"):
        TokenData.open(tmp_path / "t.json")
    (tmp_path / "t.json").unlink()
    with pytest.raises(DataError, match=r"t.json not found"):
        TokenData.open(tmp_path / "t.bin")


def test_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match=r"tokenizer '.*nope': no such directory.*save_pretrained.*bytes, "
                                        r"smollm2-135m"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"tokenizer '.*empty' could not be loaded: its directory has no loadable "
                                        r"tokenizer files"):
        load_tokenizer(str(tmp_path / "empty"))


def test_hub_name_without_the_hub_says_so(tmp_path):
    """A hub name with the hub unreachable (HF_HUB_OFFLINE=1, an empty cache:
    without it, huggingface_hub retries for ~50 s here first)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-m", "zorse_fx.cli", "prepare-data", "lee", "-o", str(tmp_path / "t"),
                        "--tokenizer", "gpt2"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert r.stderr.startswith("zorse: tokenizer 'gpt2' could not be loaded: hub names resolve only where "
                               "huggingface.co is reachable or the name is in the local Hugging Face cache; save the "
                               "tokenizer with save_pretrained")
    assert not (tmp_path / "t.bin").exists()


@pytest.mark.parametrize("argv, message", [
    ([], "one of the arguments --data --tokens is required"),
    (["--data", "a.bin", "--tokens", "t.pt"], "argument --tokens: not allowed with argument --data"),
    (["--data", "a.bin", "--val-fraction", "1.5"], "--val-fraction must be in [0, 1), got 1.5"),
])
def test_train_data_options(argv, message, capsys):
    from zorse_fx.train import parse_args

    with pytest.raises(SystemExit):
        parse_args(["plan", *argv])
    assert message in capsys.readouterr().err
    d = parse_args(["plan", "--data", "a.json", "--allow-repeat", "--val-fraction", "0.1"]).data
    assert (d.data, d.tokens, d.allow_repeat, d.val_fraction) == ("a.json", None, True, 0.1)


SEQ = 32


def _two_stage_plan(captured, gb=4):
    """Two stages cut in the middle, on GPUs 0 and 1, one micro-batch of ``gb``."""
    from zorse_fx.capture import analyse

    return fixed_plan(captured, ((0,), (1,)), ((gb,), (gb,)), num_microbatches=1, global_batch_size=gb,
                      cuts=(analyse(captured).num_blocks // 2,))


def test_model_vocab_size_is_the_embedding_of_the_input_ids():
    """The embedding looked up with the model's input (torch.fx GPT: wte, not
    the position embedding wpe; torch.export HF Llama with tied embeddings);
    without stage sources, the largest first dimension of stage 0's 2-D
    parameters, an upper bound."""
    import dataclasses

    from zorse_fx.capture import capture
    from zorse_fx.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, SEQ))
    gpt = capture(GPT(GPTConfig(n_layer=2, n_embd=128, n_head=4, block_size=SEQ)), (ids, ids))
    plan = _two_stage_plan(gpt)
    assert model_vocab_size(plan, gpt.state()) == 256
    # Stage 0's attention / MLP weights have 3 * 128 or 4 * 128 rows: more than the vocabulary.
    assert model_vocab_size(dataclasses.replace(plan, sources=()), gpt.state()) in (384, 512)
    llama = tiny_llama_tied()
    assert model_vocab_size(_two_stage_plan(llama), llama.state()) == 256


def test_train_with_data_reads_only_each_ranks_rows(tmp_path, lee_docs):
    """python -m zorse_fx.train --data: three ranks (stage 1 split 2 + 1 rows
    per micro-batch), each reading only its samples of the token file, train
    the step single-process training computes on the whole batch."""
    from zorse_fx.capture import analyse

    captured = gpt3x64()
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (2, 1)), num_microbatches=2, global_batch_size=6,
                      cuts=(analyse(captured).num_blocks // 2,))
    assert plan_rank_samples(plan, 0) == [0, 1, 2, 3, 4, 5]
    assert [plan_rank_samples(plan, r) for r in (1, 2)] == [[0, 1, 3, 4], [2, 5]]
    assert model_vocab_size(plan, captured.state()) == 256
    (tmp_path / "lee.txt").write_text("\n".join(lee_docs))
    prepare_data(str(tmp_path / "lee.txt"), tmp_path / "data" / "lee", progress=False)
    data = TokenData.open(tmp_path / "data" / "lee.bin")
    batch = data.global_batch(0, global_batch_size=6, seq_len=SEQ, input_names=plan.input_names,
                              label_mode=plan.label_mode, val_fraction=0.1)
    ref_loss, _ = reference_step(captured, batch)
    plan_dir = tmp_path / "plan"
    plan.export(plan_dir)
    torch.save(captured.state(), plan_dir / "weights.pt")
    spawn_ranks(plan_dir, plan.world_size, ["--data", str(tmp_path / "data" / "lee.json"), "--steps", "1",
                                            "--val-fraction", "0.1", "--out", str(tmp_path / "run")])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] == pytest.approx(ref_loss, rel=1e-5)


def test_zorse_train_with_data(tmp_path, lee_docs):
    """`zorse prepare-data` then `zorse train --data` under torchrun (a GPT
    plan of the stage DP), holding out a validation tenth."""
    plan = tmp_path / "plan"
    assert zorse_main(["plan", "--model", "gpt", "--cluster", str(CLUSTERS / "small_hetero.yaml"), "--planner",
                       "stage_dp", "--global-batch-size", "4", "--seq-len", "32", "-o", str(plan)]) == 0
    (tmp_path / "news").mkdir()
    for i, doc in enumerate(lee_docs[:40]):
        (tmp_path / "news" / f"{i:03d}.txt").write_text(doc)
    assert zorse_main(["prepare-data", str(tmp_path / "news"), "-o", str(tmp_path / "data" / "news")]) == 0
    assert zorse_main(["train", str(plan), "--data", str(tmp_path / "data" / "news.json"), "--val-fraction", "0.1",
                       "--steps", "2", "--out", str(tmp_path / "run")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows)
    assert not (tmp_path / "run" / "data").exists()  # --data: nothing prepared on the fly


# -- token ids checked where they are read ([Note: token ids checked where they are read]) ------------------------

def _bytes_file(tmp_path, lee_docs, name="t"):
    """The Lee corpus as a `bytes` token file (uint16, vocabulary 256, its header's max_token_id < 256)."""
    (tmp_path / f"{name}.txt").write_text("\n".join(lee_docs[:60]))
    prepare_data(str(tmp_path / f"{name}.txt"), tmp_path / name, progress=False)
    return tmp_path / f"{name}.bin"


def _poke(bin_path, offset, value):
    """Write ``value`` over the id at ``offset`` of a uint16 token file (its header left as it was)."""
    ids = np.fromfile(bin_path, dtype="<u2")
    ids[offset] = value
    ids.tofile(bin_path)


BATCH = dict(global_batch_size=4, seq_len=SEQ, label_mode="shifted", **LM)
NOT_PREPARED = ("its header says max_token_id {m}: the .bin file or its header was changed after `zorse "
                "prepare-data` wrote them")
REDO = "prepare the data again with the model's tokenizer (`zorse prepare-data --tokenizer ...`)"


def test_token_id_beyond_vocab_in_first_batch_not_in_header_refused(tmp_path, lee_docs):
    """The .bin edited after prepare-data (the header's max_token_id still
    admits every id): the whole-file scan names the id, its token offset and
    sequence chunk, the largest id, the header's claim and the fix; a rank's
    first batch (no scan) names the step, the sample and the offset."""
    path = _bytes_file(tmp_path, lee_docs)
    m = TokenData.open(path).header["max_token_id"]
    off = 2 * (SEQ + 1) + 5  # sample 2 of step 1
    _poke(path, off, 300)
    with pytest.raises(DataError) as e:
        TokenData.open(path).check_vocab(256, seq_len=SEQ)
    assert str(e.value) == (
        f"token file {path} (tokenizer 'bytes', vocabulary 256) has token id 300, but the model's vocabulary is 256 "
        f"(ids must be < 256): the first such id is at token offset {off} (sequence chunk 2 of {SEQ + 1} tokens), "
        f"the largest is 300; {NOT_PREPARED.format(m=m)}; {REDO}, or train a model whose embedding has at least 301 "
        f"rows")
    data = TokenData.open(path)
    data.check_vocab(256, scan=False)  # a rank: the header's claim passes
    with pytest.raises(DataError) as e:
        data.global_batch(0, **BATCH)
    assert str(e.value) == (
        f"token file {path} (tokenizer 'bytes', vocabulary 256): the batch of training step 1 has token id 300, "
        f"outside the model's vocabulary, [0, 256), in sample 2 at token offset {off} "
        f"({NOT_PREPARED.format(m=m)}); {REDO}")
    data.global_batch(0, samples=[0, 1, 3], **BATCH)  # a rank that does not read sample 2: its rows are fine


def test_token_id_beyond_vocab_in_later_step_batch_named(tmp_path, lee_docs):
    """An id past the vocabulary in step 4's batch: steps 1-3 read, step 4's
    batch refused naming step 4 and the sample; the scan finds it first."""
    path = _bytes_file(tmp_path, lee_docs)
    off = (3 * 4 + 1) * (SEQ + 1) + SEQ  # sample 1 of step 4, its last token (a label only)
    _poke(path, off, 256)
    data = TokenData.open(path)
    data.check_vocab(256, scan=False)
    for step in range(3):
        data.global_batch(step, **BATCH)
    with pytest.raises(DataError, match=rf"the batch of training step 4 has token id 256, outside the model's "
                                        rf"vocabulary, \[0, 256\), in sample 1 at token offset {off} "):
        data.global_batch(3, **BATCH)
    with pytest.raises(DataError, match=rf"has token id 256, .*: the first such id is at token offset {off} "
                                        rf"\(sequence chunk 13 of {SEQ + 1} tokens\)"):
        TokenData.open(path).check_vocab(256, seq_len=SEQ)


def test_token_id_beyond_vocab_with_header_edited_refused(tmp_path):
    """A header that understates its .bin (max_token_id 255 over ids up to
    999, vocabulary 256 claimed): the header passes, the scan does not."""
    ids = (np.arange(4 * 8 * (SEQ + 1)) % 1000).astype("<u2")
    ids.tofile(tmp_path / "e.bin")
    (tmp_path / "e.json").write_text(json.dumps({
        "format": "zorse_fx.tokens", "version": 1, "dtype": "uint16", "vocab_size": 256, "tokenizer": "bytes",
        "eos_id": None, "num_documents": 1, "num_tokens": ids.size, "max_token_id": 255, "source": "edited"}))
    with pytest.raises(DataError, match=r"has token id 256, but the model's vocabulary is 256 \(ids must be < 256\): "
                                        r"the first such id is at token offset 256 \(sequence chunk 7 of 33 tokens\), "
                                        r"the largest is 999; its header says max_token_id 255"):
        TokenData.open(tmp_path / "e.bin").check_vocab(256, seq_len=SEQ)
    with pytest.raises(DataError, match=r"the batch of training step 2 has token id 256, outside the tokenizer's "
                                        r"vocabulary \(its header's vocab_size\), \[0, 256\), in sample 3 at token "
                                        r"offset 256 "):
        TokenData.open(tmp_path / "e.bin").global_batch(1, **BATCH)  # no check_vocab: the header's vocabulary


def test_negative_token_id_in_later_step_batch_named(lee_bytes):
    """A legacy tensor with a negative id in step 3's batch: the scan names
    it and its offset; the batch that reads it names the step and sample."""
    ids = lee_bytes[:4000].clone()
    off = (2 * 4 + 3) * (SEQ + 1) + 7  # sample 3 of step 3
    ids[off] = -3
    with pytest.raises(DataError) as e:
        TokenData.from_tensor(ids, source="neg.pt").check_vocab(256, seq_len=SEQ)
    assert str(e.value) == (f"token file neg.pt has negative token id -3 at token offset {off} (sequence chunk 11 of "
                            f"{SEQ + 1} tokens); token ids must be in [0, 256) (the model's vocabulary); {REDO}")
    data = TokenData.from_tensor(ids, source="neg.pt")
    data.global_batch(1, **BATCH)
    with pytest.raises(DataError, match=rf"neg.pt: the batch of training step 3 has token id -3, negative, in sample 3 "
                                        rf"at token offset {off}; "):
        data.global_batch(2, **BATCH)


def test_token_id_beyond_vocab_refused_before_ranks_start(tmp_path, lee_docs, capsys, monkeypatch):
    """`zorse train --data` with an id past the vocabulary that the header
    does not admit to: one `zorse:` line from the pre-flight scan, exit 1, no
    rank started (launch is never reached)."""
    import zorse_fx.runtime.launch as launch_mod

    monkeypatch.setattr(launch_mod, "launch", lambda *a, **kw: pytest.fail("a rank was started"))
    captured = gpt3x64()
    plan = _two_stage_plan(captured)
    plan.export(tmp_path / "plan")
    torch.save(captured.state(), tmp_path / "plan" / "weights.pt")
    path = _bytes_file(tmp_path, lee_docs)
    off = 10 * (SEQ + 1)
    _poke(path, off, 4000)
    assert zorse_main(["train", str(tmp_path / "plan"), "--data", str(path), "--steps", "4",
                       "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"zorse: token file {path} (tokenizer 'bytes', vocabulary 256) has "
                                               f"token id 4000, but the model's vocabulary is 256"), err
    assert f"at token offset {off} (sequence chunk 10 of {SEQ + 1} tokens)" in err[0] and err[0].endswith(" rows")


def test_token_id_beyond_vocab_at_step_4_stops_ranks_with_one_line(tmp_path, lee_docs):
    """The ranks alone (no pre-flight scan: `python -m zorse_fx.train` started
    by hand): steps 1-3 train, step 4's batch holds id 300 (the header
    admits none past its max_token_id); every rank stops with one line naming
    the step, the sample and the offset, not an IndexError in the embedding."""
    import re

    captured = gpt3x64()
    plan = _two_stage_plan(captured)
    plan.export(tmp_path / "plan")
    torch.save(captured.state(), tmp_path / "plan" / "weights.pt")
    path = _bytes_file(tmp_path, lee_docs)
    off = (3 * 4 + 2) * (SEQ + 1) + 3  # sample 2 of step 4
    _poke(path, off, 300)
    run = tmp_path / "run"
    with pytest.raises(AssertionError) as got:
        spawn_ranks(tmp_path / "plan", plan.world_size, ["--data", str(path), "--steps", "4", "--out", str(run)])
    report = str(got.value)
    assert "IndexError" not in report and "Traceback" not in report
    for r in range(plan.world_size):
        assert re.search(rf"^zorse: rank {r} \(stage {r}\): token file {re.escape(str(path))} \(tokenizer 'bytes', "
                         rf"vocabulary 256\): the batch of training step 4 has token id 300, outside the model's "
                         rf"vocabulary, \[0, 256\), in sample 2 at token offset {off} ", report, re.M), report
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
