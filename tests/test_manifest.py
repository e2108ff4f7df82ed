import pytest

from jagg_pipeline.config.fields import from_dict
from jagg_pipeline.config.run import RunConfig
from jagg_pipeline.io.manifest import (
    ManifestError,
    check_derived_from,
    check_input,
    digest_path,
    manifest_path,
    write_manifest,
)


def test_directory_and_file_outputs_carry_manifests_that_consumers_check(tmp_path):
    config = RunConfig()
    rollout = tmp_path / "rollout"
    rollout.mkdir()
    (rollout / "shard-0.safetensors").write_bytes(b"abc")
    before = digest_path(rollout)
    write_manifest(rollout, stage="rollout", config=config, seeds={"round": 3})
    assert manifest_path(rollout) == rollout / "manifest.json"
    assert digest_path(rollout) == before  # the manifest does not change the digest
    scores = tmp_path / "scores.parquet"
    scores.write_bytes(b"table")
    write_manifest(scores, stage="score", config=config, inputs={"rollouts": rollout})
    assert manifest_path(scores).name == "scores.parquet.manifest.json"

    manifest = check_input(rollout, stage="rollout", config=config, sections=["sampler"])
    assert manifest["seeds"] == {"round": 3}
    check_derived_from(
        scores, check_input(scores, stage="score", config=config), "rollouts", rollout
    )

    other = from_dict(RunConfig, {"sampler": {"num_steps": 12}})
    with pytest.raises(
        ManifestError, match=rf"{rollout}: was made with a different config section sampler"
    ):
        check_input(rollout, stage="rollout", config=other, sections=["sampler", "backbone"])
    check_input(rollout, stage="rollout", config=other, sections=["backbone"])
    with pytest.raises(ManifestError, match="is a 'rollout' output, expected train"):
        check_input(rollout, stage="train", config=config)
    shard = rollout / "shard-0.safetensors"
    shard.write_bytes(b"changed")
    # Bytes changed under an unchanged manifest: the consumer that reads them refuses them.
    with pytest.raises(ManifestError, match=rf"^{shard}: corrupt or changed"):
        check_input(rollout, stage="rollout", config=config)
    # Another rollout in its place (its own manifest): the scores were not computed from it.
    write_manifest(rollout, stage="rollout", config=config, seeds={"round": 3})
    with pytest.raises(ManifestError, match="was not computed from"):
        check_derived_from(
            scores, check_input(scores, stage="score", config=config), "rollouts", rollout
        )
    with pytest.raises(ManifestError, match="no manifest"):
        check_input(tmp_path / "missing", stage="rollout", config=config)


def test_atomic_outputs_get_the_mode_of_a_plain_file(tmp_path):
    """Staged through a private temporary file, an output still ends with the umask's mode."""
    import os

    from jagg_pipeline.io.artifacts import atomic_write_text

    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    atomic = atomic_write_text(tmp_path / "atomic.txt", "x")
    assert os.stat(atomic).st_mode & 0o777 == os.stat(plain).st_mode & 0o777
