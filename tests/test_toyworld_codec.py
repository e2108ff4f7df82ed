import pytest
import torch

from jagg_pipeline.rewards import toy_scene as data
from jagg_pipeline.toyworld.codec import PixelShuffleCodec, to_uint8, to_unit_range


def test_codec_is_exactly_lossless_in_both_layouts(tmp_path):
    codec = PixelShuffleCodec()
    images = data.sample_batch(8, torch.Generator().manual_seed(0)).images
    latents = codec.encode(to_unit_range(images)).latent_dist.sample()
    assert latents.shape == (8, 12, 16, 16)
    assert torch.equal(to_uint8(codec.decode(latents).sample), images)
    video = codec.decode(latents[:, :, None], return_dict=False)[0]
    assert video.shape == (8, 3, 1, 32, 32)
    assert torch.equal(to_uint8(video[:, :, 0]), images)
    codec.save_pretrained(tmp_path)
    loaded = PixelShuffleCodec.from_pretrained(tmp_path)
    assert loaded.config.factor == 2 and loaded.temperal_downsample == [False]
    assert 2 ** (len(loaded.config.block_out_channels) - 1) == 2  # what the KL-VAE contract reads


def test_codec_rejects_inconsistent_configs():
    with pytest.raises(ValueError, match="power of two"):
        PixelShuffleCodec(factor=3)
    with pytest.raises(ValueError, match="z_dim == 48"):
        PixelShuffleCodec(factor=4, block_out_channels=(48, 48, 48), z_dim=12)
