"""plots/ (the viewer and its helpers) called directly: packed weights round-trip, tokens shown readably,
the top keys of a hand-made map, and the self-contained HTML viewer in a real headless Chromium."""
import base64
import re
import struct

import pytest
import torch

from lab.plots import format_top_keys, label, pack_weights, token_pieces, top_keys, write_views
from helpers import VOCAB, needs_chromium, sharp_model
from data.tokenizer import CharTokenizer, TiktokenTokenizer

GQA = {"n_head": 4, "n_kv_head": 2}


def test_packed_weights_round_trip_to_1e_5():
    maps = torch.softmax(torch.randn(2, 3, 7, 7).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf")), -1)
    raw = base64.b64decode(pack_weights(maps))
    values = torch.tensor(struct.unpack(f"<{len(raw) // 2}H", raw), dtype=torch.float64) / 65535
    rows, cols = torch.tril_indices(7, 7)
    assert (values.view(2, 3, -1) - maps[..., rows, cols].double()).abs().max() < 1e-5


def test_bpe_tokens_are_shown_readably():
    tok = TiktokenTokenizer.train(["the cat sat on the mat. " * 50], vocab_size=300)
    text = "the cat\n—é"
    pieces = token_pieces(tok, tok.encode(text).tolist())
    assert "".join(pieces).startswith("the cat\n")
    assert any(p.startswith("\\x") for p in pieces)  # a byte of a UTF-8 character, spelled out
    assert label("\n") == "↵" and label(" the") == "␣the" and label("\x07") == "\\x07"


def test_top_keys_of_a_hand_made_map():
    maps = torch.zeros(1, 2, 4, 4)
    maps[0, 0, 3] = torch.tensor([0.1, 0.6, 0.3, 0.0])
    maps[0, 1, 3] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    keys = top_keys(maps, 3, 2)
    assert keys[0][0] == [(pytest.approx(0.6), 1), (pytest.approx(0.3), 2)] and keys[0][1][0] == (1.0, 3)
    text = format_top_keys(maps, ["a", "b", "c", "d"], 3, 2)
    assert "L0 H0  0.600 'b'@1  0.300 'c'@2" in text


# ----------------------------------------------------------------------------- the viewer in a real browser


def cell_numbers(dom, cls):
    return [float(x) for x in re.findall(rf'<t[dh] class="{cls}"[^>]*>([0-9.]+)</t[dh]>', dom)]


@needs_chromium
def test_viewer_builds_its_page_in_headless_chromium(tmp_path, chromium):
    tok = CharTokenizer("".join(sorted(set(VOCAB + "<>/!-"))))  # ids in code-point order
    model = sharp_model(vocab=tok.vocab_size, block_size=96, **GQA)  # 2 layers x 4 heads
    text = "ROMEO: But soft, what light\nthrough yonder </script><!--<script> window"  # markup stays text
    idx = torch.as_tensor(tok.encode(text))[None]
    views = write_views(model, idx, tok, tmp_path, title="test <viewer>", meta="a tiny model", query=9)
    html = views["html"].resolve()
    profile = str(tmp_path / "profile")

    dom = chromium(profile, "--dump-dom", html.as_uri())
    assert 'data-ready="1"' in dom, "the script did not run to its end"
    cells = re.findall(r'<td class="cell[^"]*" data-layer="(\d+)" data-head="(\d+)"', dom)
    assert sorted((int(l), int(h)) for l, h in cells) == [(l, h) for l in range(2) for h in range(4)]
    assert len(re.findall(r'<span class="tok', dom)) == idx.size(1)  # one panel: one span per token
    shown = "".join(re.findall(r'<span class="tok[^"]*"[^>]*>([^<]*)</span>', dom))  # the tokens' text (not spaces)
    assert "&lt;/script&gt;&lt;!--&lt;script&gt;" in shown  # the prompt's markup, shown as text
    assert re.search(r'id="numbers" data-query="9" data-layer="1" data-head="0"', dom)
    weights = cell_numbers(dom, "w")
    assert len(weights) == 10  # keys 0..9 of query 9
    assert sum(weights) == pytest.approx(1.0, abs=2e-3)  # shown to 4 decimals
    assert weights == pytest.approx(views["maps"][1, 0, 9, :10].flip(0).tolist(), abs=6e-5)  # nearest first
    assert "<title>test &lt;viewer&gt;</title>" in html.read_text(encoding="utf-8")  # text, never markup

    # a link to all heads of layer 0, query 20: one panel per head, each row of numbers sums to 1
    dom = chromium(profile, "--dump-dom", html.as_uri() + "#L0Hallq20")
    assert len(re.findall(r'<div class="panel" data-head="\d"', dom)) == 4
    sums = cell_numbers(dom, "sum")
    assert len(sums) == 4 and all(s == pytest.approx(1.0, abs=1e-3) for s in sums)
    assert len(cell_numbers(dom, "w")) == 4 * 21

    shot = tmp_path / "shot.png"
    chromium(profile, f"--screenshot={shot}", "--window-size=1200,900", html.as_uri())
    import matplotlib.image
    img = matplotlib.image.imread(shot)[..., :3]  # (H, W, 3) floats
    colors = {tuple(c) for c in (img[::7, ::7] * 255).astype(int).reshape(-1, 3).tolist()}
    assert img.shape[:2] == (900, 1200) and img.std() > 0.05 and len(colors) > 50, "the screenshot looks blank"

