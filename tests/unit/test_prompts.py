"""Prompt files: each format parsed and resolved, every bad input named by line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from renderfleet.errors import InputError
from renderfleet.prompts import MAX_LINE_BYTES, FileSummary, detect_format, validate_file
from renderfleet.prompts.txt import JSON_LINE
from renderfleet.spec import MAX_NAME_LEN, Prompt, RenderParams, derive_seed, index_name
from testing.prompts import iter_prompts

PARAMS = RenderParams(steps=30, width=512, height=512, guidance=7.5, negative_prompt="blurry", seed=42)


def write(tmp_path: Path, name: str, content: str | bytes) -> str:
    """Write ``content`` to ``tmp_path/name`` (gzipped if it ends .gz); return the path."""
    data = content.encode() if isinstance(content, str) else content
    path = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return str(path)


def jsonl(*rows: object) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def problems_of(path: str, **kwargs: int) -> list[str]:
    with pytest.raises(InputError) as info:
        validate_file(path, **kwargs)
    return info.value.problems


def assert_problem(path: str, line: int | None, reason: str) -> None:
    """Some problem starts ``path:line: `` (or ``path: ``) and mentions ``reason``."""
    prefix = f"{path}: " if line is None else f"{path}:{line}: "
    found = problems_of(path)
    assert any(p.startswith(prefix) and reason in p for p in found), found


def default_prompt(index: int, text: str) -> Prompt:
    return Prompt(
        index=index,
        name=index_name(index),
        prompt=text,
        negative_prompt="blurry",
        seed=derive_seed(42, index),
        steps=30,
        guidance=7.5,
        width=512,
        height=512,
    )


# ---- formats ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a.txt", ("txt", False)),
        ("a.jsonl", ("jsonl", False)),
        ("a.csv", ("csv", False)),
        ("dir.v2/a.jsonl.gz", ("jsonl", True)),
        ("A.TXT.GZ", ("txt", True)),
    ],
)
def test_detect_format_reads_suffix_and_gz(name: str, expected: tuple[str, bool]) -> None:
    assert detect_format(name) == expected


@pytest.mark.parametrize("name", ["a.json", "a.gz", "prompts", "a.txt.bz2", "txt"])
def test_detect_format_rejects_unknown_suffix_naming_the_file(name: str) -> None:
    with pytest.raises(InputError) as info:
        detect_format(name)
    assert info.value.problems[0].startswith(f"{name}: unsupported prompt file type")


@pytest.mark.parametrize("name", ["p.txt", "p.txt.gz"])
def test_txt_skips_blanks_and_comments_and_strips(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, name, "# header\n  a red fox  \n\n   \n  # indented comment\nblue\tsky\r\nlast")
    summary = validate_file(path)
    assert summary == FileSummary(path=path, format="txt", total=3, digest=summary.digest, has_ids=False)
    assert list(iter_prompts(path, PARAMS)) == [
        default_prompt(0, "a red fox"),
        default_prompt(1, "blue\tsky"),
        default_prompt(2, "last"),
    ]


MUGS = jsonl({"prompt": "product photo of a ceramic mug", "id": "m-1"}, {"prompt": "a teapot", "id": "m-2"})


@pytest.mark.parametrize("name", ["mugs.txt", "mugs.txt.gz"])
def test_txt_of_json_lines_is_refused_at_its_first_such_line_with_the_hint(tmp_path: Path, name: str) -> None:
    # Issue 46, item 3: each line rendered as '{"prompt": ...}', its id dropped, without a word.
    path = write(tmp_path, name, "# mugs\n" + MUGS)
    found = problems_of(path)
    assert found == [f"{path}:2: {JSON_LINE}"]
    assert "name the file .jsonl" in found[0] and "--format txt" in found[0]


def test_txt_of_json_lines_renders_as_written_when_named_txt_and_the_same_lines_as_jsonl_are_read(
    tmp_path: Path,
) -> None:
    txt = write(tmp_path, "mugs.txt", MUGS + '{not json}\n{"no": "prompt key"}\n')
    assert validate_file(txt, format="txt").total == 4
    assert next(iter_prompts(txt, PARAMS)).prompt == MUGS.splitlines()[0]
    assert validate_file(write(tmp_path, "other.txt", '{not json}\n{"no": "prompt key"}\n')).total == 2
    lines = write(tmp_path, "mugs.jsonl", MUGS)
    assert (validate_file(lines).has_ids, [p.name for p in iter_prompts(lines, PARAMS)]) == (True, ["m-1", "m-2"])


def test_a_format_other_than_the_names_is_refused_naming_both(tmp_path: Path) -> None:
    path = write(tmp_path, "mugs.txt", MUGS)
    with pytest.raises(InputError) as info:
        validate_file(path, format="jsonl")
    assert info.value.problems == [f"{path}: --format jsonl, but the file's name says txt: rename it, the name decides"]


@pytest.mark.parametrize("name", ["p.jsonl", "p.jsonl.gz"])
def test_jsonl_resolves_fields_against_params(tmp_path: Path, name: str) -> None:
    path = write(
        tmp_path,
        name,
        jsonl(
            {"prompt": "plain"},
            {
                "prompt": "full",
                "id": "hero",
                "negative_prompt": "dark",
                "seed": 7,
                "steps": 12,
                "guidance": 3,
                "width": 768,
                "height": 1024,
            },
        )
        + "\n   \n"
        + jsonl({"prompt": "numeric id", "id": 12, "seed": 0}),
    )
    summary = validate_file(path)
    assert (summary.format, summary.total, summary.has_ids) == ("jsonl", 3, True)
    got = list(iter_prompts(path, PARAMS))
    assert got[0] == default_prompt(0, "plain")
    assert got[1] == Prompt(
        index=1,
        name="hero",
        prompt="full",
        negative_prompt="dark",
        seed=7,
        steps=12,
        guidance=3.0,
        width=768,
        height=1024,
    )
    assert isinstance(got[1].guidance, float)
    assert (got[2].name, got[2].seed, got[2].index) == ("12", 0, 2)


@pytest.mark.parametrize("name", ["p.csv", "p.csv.gz"])
def test_csv_resolves_columns_and_empty_cells_mean_not_given(tmp_path: Path, name: str) -> None:
    content = (
        "prompt,id,seed,steps,guidance,width,height,negative_prompt\n"
        '"a, quoted ""prompt""",one,5,20,4.5,640,480,ugly\n'
        "bare,,,,,,,\n"
        '"two\nlines",three, 9 ,,,,,\n'
    )
    path = write(tmp_path, name, content)
    summary = validate_file(path)
    assert (summary.format, summary.total, summary.has_ids) == ("csv", 3, True)
    got = list(iter_prompts(path, PARAMS))
    assert got[0] == Prompt(0, "one", 'a, quoted "prompt"', "ugly", 5, 20, 4.5, 640, 480)
    assert got[1] == default_prompt(1, "bare")
    assert (got[2].prompt, got[2].name, got[2].seed) == ("two\nlines", "three", 9)


def test_csv_with_only_a_prompt_column(tmp_path: Path) -> None:
    path = write(tmp_path, "p.csv", "prompt\nfirst\n\nsecond\n")
    assert validate_file(path).total == 2
    assert [p.prompt for p in iter_prompts(path, PARAMS)] == ["first", "second"]


def test_utf8_bom_is_ignored(tmp_path: Path) -> None:
    path = write(tmp_path, "p.csv", "\ufeffprompt,id\nhello,x\n")
    assert validate_file(path).total == 1
    assert [p.name for p in iter_prompts(path, PARAMS)] == ["x"]


def test_unicode_prompts_survive(tmp_path: Path) -> None:
    path = write(tmp_path, "p.txt", "café ☕ 猫\n")
    assert [p.prompt for p in iter_prompts(path, PARAMS)] == ["café ☕ 猫"]


# ---- digest ---------------------------------------------------------------------


def test_digest_is_sha256_of_decompressed_content_and_stable(tmp_path: Path) -> None:
    import hashlib

    content = "one\ntwo\n"
    plain = validate_file(write(tmp_path, "a.txt", content))
    again = validate_file(write(tmp_path, "b.txt", content))
    zipped = validate_file(write(tmp_path, "c.txt.gz", content))
    changed = validate_file(write(tmp_path, "d.txt", content + "three\n"))
    assert plain.digest == hashlib.sha256(content.encode()).hexdigest()
    assert plain.digest == again.digest == zipped.digest
    assert changed.digest != plain.digest


def test_digest_covers_a_file_bigger_than_the_read_buffer(tmp_path: Path) -> None:
    import hashlib

    content = "".join(f"prompt number {i}\n" for i in range(200_000))
    summary = validate_file(write(tmp_path, "big.txt.gz", content))
    assert summary.total == 200_000
    assert summary.digest == hashlib.sha256(content.encode()).hexdigest()


# ---- bad input, each named by file and line ---------------------------------------------


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"prompt": "x"', "malformed JSON"),
        ('{"prompt": "x"} trailing', "malformed JSON: Extra data"),
        ("[1, 2]", "expected a JSON object, got array"),
        ('"just a string"', "expected a JSON object, got string"),
        ("[" * 10_000 + "]" * 10_000, "malformed JSON"),
        ('{"id": "a"}', "missing field 'prompt'"),
        ('{"prompt": ""}', "empty prompt"),
        ('{"prompt": "   "}', "empty prompt"),
        ('{"prompt": 5}', "field 'prompt' must be a string, got number"),
        ('{"prompt": "x", "steps": "10"}', "field 'steps' must be an integer, got string"),
        ('{"prompt": "x", "steps": 10.5}', "field 'steps' must be an integer, got number"),
        ('{"prompt": "x", "seed": true}', "field 'seed' must be an integer, got boolean"),
        ('{"prompt": "x", "guidance": "high"}', "field 'guidance' must be a number, got string"),
        ('{"prompt": "x", "guidance": -1}', "guidance must be >= 0"),
        ('{"prompt": "x", "guidance": NaN}', "guidance must be a finite number"),
        ('{"prompt": null}', "field 'prompt' must be a string, got null"),
        ('{"prompt": "x", "negative_prompt": 3}', "field 'negative_prompt' must be a string, got number"),
        ('{"prompt": "a\\u0000b"}', "NUL character"),
        ('{"prompt": "x", "negative_prompt": "a\\u0000b"}', "negative_prompt contains a NUL"),
        ('{"prompt": "x", "id": "' + "東京" * 40 + '"}', "id too long (240 bytes in UTF-8, limit 200)"),
        ('{"prompt": "x", "id": 1.5}', "field 'id' must be a string or integer, got number"),
        ('{"prompt": "x", "colour": "red"}', "unknown field 'colour'"),
        ('{"prompt": "x", "width": 500}', "width must be a multiple of 8, got 500"),
        ('{"prompt": "x", "height": 4104}', "height must be between 1 and 4096"),
        ('{"prompt": "x", "width": 0}', "width must be between 1 and 4096"),
        ('{"prompt": "x", "steps": 0}', "steps must be positive, got 0"),
        ('{"prompt": "x", "steps": -4}', "steps must be positive"),
        ('{"prompt": "x", "steps": 1001}', "steps must be between 1 and 1000"),
        ('{"prompt": "x", "seed": -1}', "seed must be between 0 and"),
        ('{"prompt": "x", "seed": 9223372036854775808}', "seed must be between 0 and"),
        ('{"prompt": "x", "id": ""}', "empty id"),
        ('{"prompt": "x", "id": "a/b"}', "contains a slash"),
        ('{"prompt": "x", "id": "a\\\\b"}', "contains a slash"),
        ('{"prompt": "x", "id": "."}', "must not start with '.'"),
        ('{"prompt": "x", "id": ".."}', "must not start with '.'"),
        ('{"prompt": "x", "id": ".hidden"}', "must not start with '.'"),
        ('{"prompt": "x", "id": "a\\tb"}', "contains a control character"),
        ('{"prompt": "x", "id": "caf\\u00e9\\u0085"}', "contains a control character"),
        ('{"prompt": "x", "id": "' + "i" * (MAX_NAME_LEN + 1) + '"}', "id too long"),
        ('{"prompt": "x\\ud800"}', "lone surrogate"),
    ],
)
def test_jsonl_bad_line_is_reported_at_its_line(tmp_path: Path, line: str, reason: str) -> None:
    path = write(tmp_path, "p.jsonl", '{"prompt": "fine"}\n\n' + line + "\n")
    assert_problem(path, 3, reason)


@pytest.mark.parametrize(
    ("line", "where"),
    [
        ('{"prompt": "a fox", "steps": 4', "Expecting ',' delimiter at column 31"),  # cut after a value
        ('{"prompt": "a fo', "Unterminated string starting at column 12"),  # cut inside a string
        ('  {"prompt": "x"', "Expecting ',' delimiter at column 17"),
    ],
)
@pytest.mark.parametrize("ending", ["\n", "\r\n"])
def test_jsonl_truncated_line_is_reported_at_the_column_where_it_breaks(
    tmp_path: Path, line: str, where: str, ending: str
) -> None:
    path = write(tmp_path, "p.jsonl", '{"prompt": "fine"}' + ending + line + ending + '{"prompt": "after"}' + ending)
    assert problems_of(path) == [f"{path}:2: malformed JSON: {where}"]


def test_jsonl_accepts_edge_values(tmp_path: Path) -> None:
    row = {"prompt": "x", "id": "é-ok_1", "seed": 2**63 - 1, "steps": 1000, "width": 4096, "height": 8, "guidance": 0}
    path = write(tmp_path, "p.jsonl", "  " + json.dumps(row) + "  \n")
    assert validate_file(path).total == 1
    assert next(iter_prompts(path, PARAMS)).seed == 2**63 - 1


def test_jsonl_reports_every_problem_on_a_line(tmp_path: Path) -> None:
    path = write(tmp_path, "p.jsonl", jsonl({"prompt": "", "steps": 0, "x": 1}))
    found = problems_of(path)
    assert len(found) == 3
    assert all(p.startswith(f"{path}:1: ") for p in found)


def test_duplicate_id_names_the_earlier_line(tmp_path: Path) -> None:
    path = write(tmp_path, "p.jsonl", jsonl({"prompt": "a", "id": "x"}, {"prompt": "b"}, {"prompt": "c", "id": "x"}))
    assert_problem(path, 3, "duplicate id 'x' (first used at line 1)")


def test_int_and_str_ids_that_read_the_same_are_duplicates(tmp_path: Path) -> None:
    path = write(tmp_path, "p.jsonl", jsonl({"prompt": "a", "id": 5}, {"prompt": "b", "id": "5"}))
    assert_problem(path, 2, "duplicate id '5' (first used at line 1)")


def test_id_colliding_with_an_earlier_index_name(tmp_path: Path) -> None:
    # Prompt 0 has no id, so it is named "000000"; line 2 claims that name.
    path = write(tmp_path, "p.jsonl", jsonl({"prompt": "a"}, {"prompt": "b", "id": "000000"}))
    assert_problem(path, 2, "duplicate name '000000': prompt 0 has no id")


def test_id_colliding_with_a_later_index_name(tmp_path: Path) -> None:
    path = write(tmp_path, "p.jsonl", jsonl({"prompt": "a", "id": "000002"}, {"prompt": "b", "id": "q"}, {"prompt": "c"}))
    assert_problem(path, 3, "duplicate name '000002'")
    assert "line 1" in problems_of(path)[0]


def test_index_like_ids_that_do_not_collide_are_fine(tmp_path: Path) -> None:
    rows = [
        {"prompt": "a", "id": "000000"},  # its own index name
        {"prompt": "b"},  # named 000001
        {"prompt": "c", "id": "000003"},  # prompt 3 has an id, so no clash
        {"prompt": "d", "id": "d"},
        {"prompt": "e", "id": "1"},  # "1" is not an index name ("000001" is)
        {"prompt": "f", "id": "0000001"},  # nor is a 7-digit padding
    ]
    path = write(tmp_path, "p.jsonl", jsonl(*rows))
    assert validate_file(path).total == 6
    assert [p.name for p in iter_prompts(path, PARAMS)] == ["000000", "000001", "000003", "d", "1", "0000001"]


@pytest.mark.parametrize("name", ["p.txt", "p.jsonl", "p.csv"])
def test_invalid_utf8_reported_at_its_line(tmp_path: Path, name: str) -> None:
    head = {"p.txt": b"ok\n", "p.jsonl": b'{"prompt": "ok"}\n', "p.csv": b"prompt\n"}[name]
    path = write(tmp_path, name, head + b"caf\xc3(\n")
    assert_problem(path, 2, "invalid UTF-8 at byte 4")


@pytest.mark.parametrize("name", ["p.txt", "p.jsonl.gz", "p.csv"])
def test_overlong_line_reported_and_skipped(tmp_path: Path, name: str) -> None:
    head = {"p.txt": "ok\n", "p.jsonl.gz": '{"prompt": "ok"}\n', "p.csv": "prompt\n"}[name]
    tail = {"p.txt": "after\n", "p.jsonl.gz": "[1]\n", "p.csv": 'a,"b\n'}[name]
    path = write(tmp_path, name, head + "x" * (3 * MAX_LINE_BYTES + 5) + "\n" + tail)
    found = problems_of(path)
    assert found[0] == f"{path}:2: line too long ({3 * MAX_LINE_BYTES + 6} bytes, limit {MAX_LINE_BYTES})"
    if name == "p.jsonl.gz":  # reading went on past it, line numbers intact
        assert found[1].startswith(f"{path}:3: expected a JSON object")


def test_line_exactly_at_the_limit_is_fine(tmp_path: Path) -> None:
    path = write(tmp_path, "p.txt", "y" * MAX_LINE_BYTES + "\n" + "z" * MAX_LINE_BYTES)
    assert validate_file(path).total == 2


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("p.txt", ""),
        ("p.txt", "# only comments\n\n   \n"),
        ("p.txt.gz", ""),
        ("p.jsonl", "\n\n"),
        ("p.csv", ""),
        ("p.csv", "prompt,id\n\n"),
    ],
)
def test_file_without_prompts(tmp_path: Path, name: str, content: str) -> None:
    path = write(tmp_path, name, content)
    assert problems_of(path) == [f"{path}: no prompts"]


def test_missing_file_cannot_be_read(tmp_path: Path) -> None:
    path = str(tmp_path / "absent.txt")
    assert problems_of(path) == [f"{path}: cannot read: No such file or directory"]


def test_directory_cannot_be_read(tmp_path: Path) -> None:
    (tmp_path / "d.txt").mkdir()
    assert_problem(str(tmp_path / "d.txt"), None, "cannot read:")


def test_not_really_gzip_cannot_be_read(tmp_path: Path) -> None:
    path = str(tmp_path / "p.txt.gz")
    Path(path).write_bytes(b"plain text\n")
    assert_problem(path, None, "cannot read: Not a gzipped file")


def test_truncated_gzip_cannot_be_read(tmp_path: Path) -> None:
    path = str(tmp_path / "p.txt.gz")
    Path(path).write_bytes(gzip.compress(b"line\n" * 10_000)[:-20])
    assert_problem(path, None, "cannot read:")


def test_iter_prompts_of_missing_file_raises_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        list(iter_prompts(str(tmp_path / "absent.jsonl"), PARAMS))


def test_iter_prompts_on_a_file_changed_after_validation(tmp_path: Path) -> None:
    path = write(tmp_path, "p.jsonl", jsonl({"prompt": "a"}) + "{oops\n")
    with pytest.raises(InputError) as info:
        list(iter_prompts(path, PARAMS))
    assert info.value.problems[0].startswith(f"{path}:2: malformed JSON")


# ---- .csv problems -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        ("id,seed", "no 'prompt' column"),
        ("id,colour", "no 'prompt' column"),
        ("prompt,seed,seed", "duplicate column 'seed'"),
        ("Prompt,SEED,seed", "duplicate column 'seed'"),
    ],
)
def test_csv_bad_header_reported_at_line_1(tmp_path: Path, header: str, reason: str) -> None:
    path = write(tmp_path, "p.csv", header + "\nx,1\n")
    assert_problem(path, 1, reason)


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ("x,1", "expected 3 cells (as in the header), got 2"),
        ("x,1,2,3", "expected 3 cells (as in the header), got 4"),
        (",,", "empty prompt"),
        ("x,ten,", "column 'steps' must be an integer, got 'ten'"),
        ("x,1.5,", "column 'steps' must be an integer, got '1.5'"),
        ("x,0,", "steps must be positive"),
        ("x,,lots", "column 'width' must be an integer, got 'lots'"),
        ("x,,12", "width must be a multiple of 8, got 12"),
    ],
)
def test_csv_bad_row_reported_at_its_line(tmp_path: Path, row: str, reason: str) -> None:
    path = write(tmp_path, "p.csv", "prompt,steps,width\nfine,,\n" + row + "\n")
    assert_problem(path, 3, reason)


def test_csv_guidance_and_id_problems(tmp_path: Path) -> None:
    path = write(tmp_path, "p.csv", "prompt,guidance,id\na,high,x\nb,-2,y\nc,,x\nd,,../up\n")
    found = problems_of(path)
    assert found == [
        f"{path}:2: column 'guidance' must be a number, got 'high'",
        f"{path}:3: guidance must be >= 0, got -2.0",
        f"{path}:4: duplicate id 'x' (first used at line 2)",
        f"{path}:5: id '../up' must not start with '.'",
    ]


def test_csv_multiline_record_reported_at_its_first_line(tmp_path: Path) -> None:
    path = write(tmp_path, "p.csv", 'prompt,steps\n"multi\nline\nprompt",zero\n')
    assert_problem(path, 2, "column 'steps' must be an integer")


# ---- the problem cap -------------------------------------------------------------------


def test_max_problems_caps_the_list_and_says_more_were_dropped(tmp_path: Path) -> None:
    path = write(tmp_path, "p.jsonl", "not json\n" * 100)
    found = problems_of(path, max_problems=5)
    assert len(found) == 6
    assert [p.split(": ")[0] for p in found[:5]] == [f"{path}:{n}" for n in range(1, 6)]
    assert found[5] == f"{path}: ... and more problems not shown"


def test_exactly_max_problems_has_no_more_line(tmp_path: Path) -> None:
    path = write(tmp_path, "p.jsonl", "not json\n" * 5 + jsonl({"prompt": "ok"}))
    found = problems_of(path, max_problems=5)
    assert len(found) == 5
    assert "more problems" not in found[-1]


def test_default_cap_is_50(tmp_path: Path) -> None:
    path = write(tmp_path, "p.jsonl", "[]\n" * 80)
    assert len(problems_of(path)) == 51


def test_max_problems_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_problems"):
        validate_file(write(tmp_path, "p.txt", "a\n"), max_problems=0)


# ---- issue 14: names in bytes, NUL, CR-only files, UTF-16, pandas jsonl ------------------


def test_a_long_non_ascii_id_is_refused_by_its_bytes_not_only_its_characters(tmp_path: Path) -> None:
    # 80 characters pass the character limit, but 240 bytes make a file name too long.
    path = write(tmp_path, "p.jsonl", jsonl({"prompt": "a", "id": "東京" * 33}, {"prompt": "b", "id": "東京" * 40}))
    assert_problem(path, 2, "id too long (240 bytes in UTF-8, limit 200)")
    assert len(problems_of(path)) == 1  # 198 bytes are fine
    csv_path = write(tmp_path, "p.csv", "prompt,id\nx," + "é" * 101 + "\n")
    assert_problem(csv_path, 2, "id too long (202 bytes in UTF-8")


@pytest.mark.parametrize(
    ("name", "content", "line"),
    [
        ("p.txt", "fine\nbad\x00prompt\n", 2),
        ("p.csv", "prompt,negative_prompt\nok,\nx,bad\x00\n", 3),
    ],
)
def test_a_nul_in_a_prompt_is_refused_at_its_line(tmp_path: Path, name: str, content: str, line: int) -> None:
    assert_problem(write(tmp_path, name, content), line, "NUL character")


@pytest.mark.parametrize("name", ["p.txt", "p.jsonl", "p.csv"])
def test_old_mac_cr_only_line_endings_are_reported_not_read_as_one_prompt(tmp_path: Path, name: str) -> None:
    rows = {"p.txt": ["a cat", "a dog"], "p.jsonl": ['{"prompt": "a"}', '{"prompt": "b"}'], "p.csv": ["prompt", "a", "b"]}[
        name
    ]
    path = write(tmp_path, name, "\r".join(rows) + "\r")
    assert_problem(path, 1, "CR-only")


def test_crlf_line_endings_are_fine(tmp_path: Path) -> None:
    assert validate_file(write(tmp_path, "p.txt", "a cat\r\na dog\r\n")).total == 2


@pytest.mark.parametrize("bom", ["utf-16-le", "utf-16-be"])
def test_a_utf16_file_is_named_as_utf16(tmp_path: Path, bom: str) -> None:
    data = ("\ufeff" + "a cat\n").encode(bom)
    found = problems_of(write(tmp_path, "p.txt", data))
    assert len(found) == 1 and "UTF-16" in found[0] and "save it as UTF-8" in found[0]


def test_jsonl_from_pandas_null_means_not_given_and_integral_floats_are_integers(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "p.jsonl",
        jsonl(
            {"prompt": "a", "id": None, "seed": 3.0, "steps": None, "negative_prompt": None, "guidance": None},
            {"prompt": "b", "id": "x", "seed": None, "width": 64.0},
        ),
    )
    assert validate_file(path).total == 2
    first, second = iter_prompts(path, PARAMS)
    assert first == default_prompt(0, "a").__class__(**{**default_prompt(0, "a").__dict__, "seed": 3})
    assert second.name == "x" and second.seed == derive_seed(42, 1) and second.width == 64
    assert type(first.seed) is int and type(second.width) is int


def test_csv_headers_are_case_insensitive_and_unknown_columns_ignored_with_a_warning(tmp_path: Path) -> None:
    path = write(tmp_path, "p.csv", "Prompt,Seed,Notes,\na cat,5,keep this,\na dog,,,\n")
    summary = validate_file(path)
    assert summary.total == 2
    assert summary.warnings == (
        f"{path}:1: ignoring column(s) 'Notes', '' (known: prompt, id, negative_prompt, "
        "seed, steps, guidance, width, height, scheduler, skip_stages)",
    )
    first, second = iter_prompts(path, PARAMS)
    assert (first.prompt, first.seed) == ("a cat", 5) and (second.prompt, second.seed) == ("a dog", derive_seed(42, 1))
    assert validate_file(write(tmp_path, "q.csv", "prompt\nx\n")).warnings == ()


# ---- issue 21: ids that hide or reorder what they show --------------------------------------

# (id, the character named): bidi controls, zero-width and other format characters (Cf),
# controls (Cc), line separators and a lone surrogate (from a message; a file's is refused earlier).
HIDDEN_IDS = [
    ("a\u202egnp.exe", "U+202E RIGHT-TO-LEFT OVERRIDE"),  # shows as "aexe.png"
    ("a\u202ab", "U+202A LEFT-TO-RIGHT EMBEDDING"),
    ("a\u202db", "U+202D LEFT-TO-RIGHT OVERRIDE"),
    ("a\u2066b\u2069", "U+2066 LEFT-TO-RIGHT ISOLATE"),
    ("a\u2069", "U+2069 POP DIRECTIONAL ISOLATE"),
    ("a\u200eb", "U+200E LEFT-TO-RIGHT MARK"),
    ("a\u200fb", "U+200F RIGHT-TO-LEFT MARK"),
    ("a\u061cb", "U+061C ARABIC LETTER MARK"),
    ("cat\u200b", "U+200B ZERO WIDTH SPACE"),
    ("c\u200cat", "U+200C ZERO WIDTH NON-JOINER"),
    ("c\u200dat", "U+200D ZERO WIDTH JOINER"),
    ("c\u2060at", "U+2060 WORD JOINER"),
    ("c\ufeffat", "U+FEFF ZERO WIDTH NO-BREAK SPACE"),
    ("c\u00adat", "U+00AD SOFT HYPHEN"),
    ("a\tb", "U+0009"),
    ("a\x1bb", "U+001B"),
    ("café\x85", "U+0085"),
    ("a\u2028b", "U+2028 LINE SEPARATOR"),
]


@pytest.mark.parametrize(("ident", "named"), HIDDEN_IDS)
def test_an_id_with_an_invisible_or_reordering_character_is_refused_naming_it(
    tmp_path: Path, ident: str, named: str
) -> None:
    path = write(tmp_path, "p.jsonl", jsonl({"prompt": "fine"}, {"prompt": "x", "id": ident}))
    [problem] = problems_of(path)
    assert problem.startswith(f"{path}:2: id ") and problem.endswith(named), problem
    assert ident not in problem  # shown escaped: the message itself cannot be reordered
    if "\t" not in ident and "\x85" not in ident:  # csv: a cell of its own (a tab or NEL is a csv matter)
        csv_path = write(tmp_path, "p.csv", f"prompt,id\nfine,\nx,{ident}\n")
        assert problems_of(csv_path) == [problem.replace(f"{path}:2:", f"{csv_path}:3:", 1)]


def test_visible_non_ascii_ids_are_still_fine(tmp_path: Path) -> None:
    ids = ["café", "東京-1", "שלום", "مرحبا", "a\u00a0b", "x\u0301"]  # RTL letters are text, not controls
    path = write(tmp_path, "p.jsonl", jsonl(*({"prompt": "x", "id": i} for i in ids)))
    assert validate_file(path).total == len(ids)
    assert [p.name for p in iter_prompts(path, PARAMS)] == ids
