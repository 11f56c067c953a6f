"""The top-k examples shown as what they are: images, decoded tokens, text columns, table rows."""

from __future__ import annotations

import base64
import dataclasses
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from matplotlib.image import imread

from gradscope.config import Config, DataConfig, ModelConfig, ReportConfig
from gradscope.errors import ConfigError
from gradscope.report.examples import Renderer, check_shown, show_examples


def config(data: DataConfig, **report) -> Config:
    return Config(model=ModelConfig(factory="unused"), data=data, report=ReportConfig(**report))


def pixels(uri: str) -> np.ndarray:
    assert uri.startswith("data:image/png;base64,")
    return imread(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])), format="png")


def render(x: torch.Tensor, **report) -> object:
    (shown,) = Renderer(config(DataConfig(path="-", targets="y"), **report))((x,))
    return shown


def test_flat_input_with_image_shape_is_drawn_dark_ink_on_light():
    x = torch.arange(64.0)  # pixel (r, c) holds 8 r + c
    png = pixels(render(x, image_shape=[8, 8]).image)
    assert png.shape[:2] == (8, 8)
    gray = png[..., 0]
    # gray_r from min..max: value 0 is white, 63 black; the row-major order survives
    np.testing.assert_allclose(gray, 1 - x.reshape(8, 8).numpy() / 63, atol=1 / 255 + 1e-6)
    assert render(x).text.startswith("0, 1, 2")  # no image_shape: a row of values
    assert render(x).text.endswith("(64 values)")


def test_channels_first_and_last_rgb():
    chw = torch.zeros(3, 4, 5)
    chw[0] = 1.0  # all red
    for x in (chw, chw.permute(1, 2, 0)):
        png = pixels(render(x).image)
        assert png.shape[:2] == (4, 5)
        np.testing.assert_allclose(png[..., :3].reshape(-1, 3), [[1, 0, 0]] * 20)
    assert render(torch.zeros(2, 3, 4, 5)).text.endswith("(120 values)")  # 4-D: not an image


def test_one_channel_images_are_gray_as_flat_ones_are():
    x = torch.arange(64.0)
    flat = pixels(render(x, image_shape=[8, 8]).image)
    for shaped in (x.reshape(1, 8, 8), x.reshape(8, 8, 1), x.reshape(8, 8)):
        np.testing.assert_array_equal(pixels(render(shaped).image), flat)


def test_token_ids_decoded_with_a_local_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "the": 1, "cat": 2, "sat": 3}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="[PAD]").save_pretrained(tmp_path)
    ids = torch.tensor([1, 2, 3, 0, 0])
    assert render(ids, tokenizer=str(tmp_path)).text == "the cat sat"
    assert render(ids).text == "token ids: 1, 2, 3, 0, 0"
    mask = torch.tensor([1, 1, 1, 0, 0])  # attention_mask beside the ids: its runs, not "the"
    assert render(mask, tokenizer=str(tmp_path)).text == "1 ×3, 0 ×2"
    assert render(torch.tensor([0, 0, 1, 1, 1, 0])).text == "0 ×2, 1 ×3, 0 ×1"


def test_bad_tokenizer_folder_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        render(torch.tensor([1]), tokenizer=str(tmp_path))


def test_examples_read_back_by_position_with_their_show_column(tmp_path):
    n = 10
    table = pa.table({
        "x": [list(np.full(4, float(i))) for i in range(n)], "y": np.arange(n) % 2,
        "caption": [f"row {i}" for i in range(n)],
    })  # fmt: skip
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=3)
    data = DataConfig(path=str(tmp_path / "d.parquet"), inputs=["x"], targets="y")
    shown = show_examples(config(dataclasses.replace(data, show="caption")), [7, 2])
    assert sorted(shown) == [2, 7]
    assert [s.text for s in shown[7]] == ["7, 7, 7, 7", "row 7"]
    assert [s.name for s in shown[2]] == ["x", "caption"]
    with pytest.raises(Exception, match="no column 'nope' for data.show"):
        show_examples(config(dataclasses.replace(data, show="nope")), [1])


def test_image_shape_must_fit_one_flat_input(tmp_path):
    """One input of a row it draws is enough (a model's other flat inputs stay values); one it
    fits none of is refused, naming the row's inputs: every example was shown as its values."""
    torch.save({"x": torch.zeros(3, 4), "m": torch.zeros(3, 6), "y": torch.zeros(3)},
               tmp_path / "d.pt")  # fmt: skip
    data = DataConfig(path=str(tmp_path / "d.pt"), inputs=["x", "m"], targets="y")
    for fits in ([2, 2], [2, 3], [1, 2, 3]):
        check_shown(config(data, image_shape=fits))
    with pytest.raises(
        ConfigError, match=r"image_shape \[3, 3\] fits no input: .* x \[4\], m \[6\]"
    ):
        check_shown(config(data, image_shape=[3, 3]))
