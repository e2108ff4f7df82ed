import csv
import json

import pytest
import torch
from PIL import Image
from reward_models import COLOURS, caption, colour_images, tiny_models

from jagg_pipeline.cli import build_parser, main
from jagg_pipeline.rewards import load_reward, parse_spec, to_unit_float


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.getbasetemp())


def write_images(folder, names, sizes):
    folder.mkdir()
    for i, (name, (w, h)) in enumerate(zip(names, sizes, strict=True)):
        image = colour_images([name], size=max(w, h), seed=i)[0][:, :h, :w]
        pixels = (image * 255).round().byte().permute(1, 2, 0).numpy()
        Image.fromarray(pixels).save(folder / f"{i:03d}.png")


def test_help_documents_inputs_outputs_and_rewards(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["score-images", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for needle in [
        "--images",
        "--prompts",
        "--manifest",
        "--rewards",
        "--reward",
        "--set",
        "--out",
        "advantage",
        "total",
        ".parquet",
        "hpsv21",
        "pickscore",
        "clipscore",
        "jpeg_compressibility",
        "HF_HUB_OFFLINE",
    ]:
        assert needle in text, needle


def test_scores_a_folder_with_a_prompt_file(models, tmp_path):
    names = ["red", "red", "blue", "blue"]
    write_images(tmp_path / "imgs", names, [(32, 32), (40, 24), (32, 32), (24, 40)])
    (tmp_path / "prompts.txt").write_text(f"{caption('red')}\n{caption('blue')}\n")
    spec = tmp_path / "rewards.yaml"
    spec.write_text(
        "rewards:\n"
        "  weights: {hpsv21: 1.0, clipscore: 0.01}\n"
        f"  hpsv21: {{checkpoint: '{models.hps_checkpoint}', arch: '{models.hps_arch_json}'}}\n"
    )
    out = tmp_path / "out" / "scores.csv"
    argv = [
        "score-images",
        "--images",
        str(tmp_path / "imgs"),
        "--prompts",
        str(tmp_path / "prompts.txt"),
        "--images-per-prompt",
        "2",
        "--rewards",
        str(spec),
        "--set",
        f"rewards.clipscore.model={models.hf_clip_dir}",
        "--batch-size",
        "1",
        "--out",
        str(out),
    ]
    main(argv)
    with out.open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["image"] for r in rows] == ["000.png", "001.png", "002.png", "003.png"]
    assert [r["group"] for r in rows] == ["0", "0", "1", "1"]
    assert list(rows[0]) == [
        "image",
        "prompt",
        "group",
        "hpsv21",
        "clipscore",
        "total",
        "advantage",
    ]
    # the table holds what the scorer gives for the same files
    hps = load_reward(
        "hpsv21",
        parse_spec(
            "hpsv21", {"checkpoint": str(models.hps_checkpoint), "arch": str(models.hps_arch_json)}
        ),
    )
    for row in rows:
        image = to_unit_float([Image.open(tmp_path / "imgs" / row["image"])])
        expected = float(hps(image, [row["prompt"]])[0])
        assert float(row["hpsv21"]) == pytest.approx(expected, abs=1e-6)
        assert float(row["total"]) == pytest.approx(
            float(row["hpsv21"]) + 0.01 * float(row["clipscore"]), abs=1e-5
        )
        assert float(row["hpsv21"]) > 0.5  # every image matches its prompt
    manifest = json.loads((tmp_path / "out" / "scores.csv.manifest.json").read_text())
    assert manifest["rows"] == 4 and manifest["rewards"]["weights"]["clipscore"] == 0.01
    assert manifest["rewards"]["clipscore"]["model"] == str(models.hf_clip_dir)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_manifest_input_and_table_formats(models, tmp_path, suffix):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    names = list(COLOURS)
    write_images(tmp_path / "imgs", names, [(32, 32)] * 4)
    manifest = tmp_path / "pairs.csv"
    with manifest.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["file", "text"])
        # mismatched on purpose for the last two images
        writer.writerows(
            [
                ["000.png", caption("red")],
                ["001.png", caption("green")],
                ["002.png", caption("yellow")],
                ["003.png", caption("blue")],
            ]
        )
    out = tmp_path / f"scores{suffix}"
    argv = [
        "score-images",
        "--images",
        str(tmp_path / "imgs"),
        "--manifest",
        str(manifest),
        "--image-column",
        "file",
        "--column",
        "text",
        "--reward",
        "pickscore",
        "--reward",
        "jpeg_compressibility=0",
        "--set",
        f"rewards.pickscore.model={models.hf_clip_dir}",
        "--set",
        f"rewards.pickscore.processor={models.hf_clip_dir}",
        "--out",
        str(out),
    ]
    main(argv)
    if suffix == ".jsonl":
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    else:
        import pyarrow.parquet as pq

        rows = pq.read_table(out).to_pylist()
    scores = torch.tensor([row["pickscore"] for row in rows])
    assert scores[:2].min() > scores[2:].max()  # matching pairs score higher
    assert all(row["jpeg_compressibility"] < 0 for row in rows)
    assert [row["total"] for row in rows] == pytest.approx(scores.tolist())


def test_errors_are_clear(models, tmp_path, capsys):
    write_images(tmp_path / "imgs", ["red", "blue"], [(32, 32)] * 2)
    (tmp_path / "one.txt").write_text("a red image\n")
    base = ["score-images", "--images", str(tmp_path / "imgs"), "--out", str(tmp_path / "o.csv")]
    with pytest.raises(SystemExit, match=r"2 images .* 1 prompts"):
        main([*base, "--prompts", str(tmp_path / "one.txt"), "--reward", "jpeg_compressibility"])
    (tmp_path / "two.txt").write_text("a red image\na blue image\n")
    with pytest.raises(SystemExit, match=r"rewards\.pickscore\.model: /nowhere not found"):
        main(
            [
                *base,
                "--prompts",
                str(tmp_path / "two.txt"),
                "--reward",
                "pickscore",
                "--set",
                "rewards.pickscore.model=/nowhere",
            ]
        )
    with pytest.raises(SystemExit, match=r"rewards\.hpsv21\.batch_szie: unknown key"):
        main(
            [
                *base,
                "--prompts",
                str(tmp_path / "two.txt"),
                "--reward",
                "hpsv21",
                "--set",
                "rewards.hpsv21.batch_szie=2",
            ]
        )
    assert not (tmp_path / "o.csv").exists()
