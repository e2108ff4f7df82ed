import json

import pytest

from jagg_pipeline.io.prompts import PromptFileError, load_prompts, read_table

PROMPTS = ["a red circle", "two cats, one dog", 'a "quoted" word']


def test_txt_skips_blank_lines(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("a red circle\n\n  two cats, one dog \n" + 'a "quoted" word\n')
    assert load_prompts(path) == PROMPTS
    with pytest.raises(PromptFileError, match="no columns"):
        load_prompts(path, column="prompt")


# What str.splitlines takes for a line end besides \n and \r.
SPLITLINES_ENDS = ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"]


@pytest.mark.parametrize("inside", SPLITLINES_ENDS, ids=ascii)
def test_a_line_holding_a_unicode_line_separator_stays_one_prompt(tmp_path, inside):
    prompts = [f"a red{inside}circle", "two cats"]
    text = tmp_path / "p.txt"
    text.write_text("\r\n".join(prompts) + "\n", encoding="utf-8", newline="")
    assert load_prompts(text) == prompts
    lines = tmp_path / "p.jsonl"
    rows = [json.dumps({"prompt": prompt}, ensure_ascii=False) for prompt in prompts]
    lines.write_text("\n".join(rows) + "\n", encoding="utf-8")
    assert load_prompts(lines) == prompts


def test_json_and_jsonl_strings_or_objects(tmp_path):
    strings = tmp_path / "anime.json"  # HPDv2 benchmark files are JSON lists of strings
    strings.write_text(json.dumps(PROMPTS))
    assert load_prompts(strings) == PROMPTS
    objects = tmp_path / "p.jsonl"
    objects.write_text(
        "".join(json.dumps({"caption": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS))
    )
    assert load_prompts(objects, column="caption") == PROMPTS
    with pytest.raises(PromptFileError, match=r"p\.jsonl: no column 'prompt' .*'caption', 'id'"):
        load_prompts(objects)


def test_csv_column(tmp_path):
    import csv

    path = tmp_path / "drawbench.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["Prompts", "Category"])
        writer.writerows([[p, "misc"] for p in PROMPTS])
    assert load_prompts(path, column="Prompts") == PROMPTS
    with pytest.raises(PromptFileError, match=r"drawbench\.csv: no column 'prompt'"):
        load_prompts(path)


def test_parquet_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "pickapic.parquet"
    pq.write_table(pa.table({"caption": PROMPTS, "n": [1, 2, 3]}), path)
    assert load_prompts(path, column="caption") == PROMPTS
    assert read_table(path)[1] == {"caption": PROMPTS[1], "n": 2}
    with pytest.raises(PromptFileError, match="not a non-empty string"):
        load_prompts(path, column="n")


def test_errors_name_the_file(tmp_path):
    with pytest.raises(PromptFileError, match=r"missing\.txt: no such file"):
        load_prompts(tmp_path / "missing.txt")
    bad = tmp_path / "p.yaml"
    bad.write_text("- a\n")
    with pytest.raises(PromptFileError, match="unsupported prompt file"):
        load_prompts(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(PromptFileError, match=r"empty\.txt: no prompts"):
        load_prompts(empty)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(PromptFileError, match=r"broken\.jsonl:2: not valid JSON"):
        load_prompts(broken)
