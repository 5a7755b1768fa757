"""Streams of tokens the tools read: a held-out text (a file, or a run's own val split made again)
as one tensor of token ids, cut into windows of a block, and the next-token loss of every window.
tools/ablate.py, lens.py, patch.py, eval_stream.py and eval_lengths.py read their text here."""
from pathlib import Path

import torch
import torch.nn.functional as F

from data.tokenizer import tokenizer_from_dict
from rules import UserError


def stream_tokens(state: dict, cfg, n=None) -> torch.Tensor:
    """The first n tokens (all: None) of cfg.text, or of the run's own val split (prepared again from
    its config): a held-out text the model never trained on."""
    tok = tokenizer_from_dict(state["tokenizer"])
    if cfg.text:
        try:
            ids = tok.encode(Path(cfg.text).expanduser().read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"text={cfg.text!r} cannot be read as UTF-8 text ({type(e).__name__})") from None
    else:
        from omegaconf import OmegaConf

        from lab.config import DataConfig
        from data.loader import TokenData
        from data.mqar import MQARData
        from data.prepare import prepare
        saved = (state.get("config") or {}).get("data")
        if saved is None:
            raise UserError("the checkpoint holds no data config (its run's val split cannot be made again): give "
                            "text=FILE, a held-out UTF-8 text")
        data_cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), saved)  # the run's own data
        try:
            if data_cfg.name == "mqar":  # generated again from its seed: the val examples one after another
                ids = MQARData(data_cfg, state["model_config"]["block_size"]).examples["val"][0].reshape(-1)[:n].tolist()
            else:
                ids = TokenData(prepare(data_cfg)).splits["val"][:n].tolist()
        except UserError as e:  # its keys are the run's, not this tool's
            raise UserError(f"the run's own val split cannot be made again here ({e}); give text=FILE, a held-out "
                            "UTF-8 text") from None
    if n is not None and len(ids) < n:
        raise UserError(f"the text has {len(ids)} tokens, fewer than tokens={n}: give a longer text= or fewer tokens")
    return torch.tensor(ids[:n], dtype=torch.long)


def windows(ids, T: int, n: int):
    """The first n windows of T + 1 tokens of ids: inputs and targets (n, T)."""
    if ids.numel() < n * T + 1:
        n = (ids.numel() - 1) // T
        if n == 0:
            raise UserError(f"the text has {ids.numel()} tokens: too few for one window of {T} (give a longer text=)")
    x = ids[:n * T].view(n, T)
    return x, ids[1:n * T + 1].view(n, T)


@torch.no_grad()
def window_losses(model, ids, L: int, batch_size: int = 8, bos=None) -> torch.Tensor:
    """The next-token loss at every position of every consecutive window of L tokens of ids:
    (windows, L); window w reads ids[w*L : (w+1)*L] and predicts ids[w*L+1 : (w+1)*L+1]. With bos
    (a data.bos=true model) it reads [bos, ids[w*L : (w+1)*L-1]] and predicts ids[w*L : (w+1)*L]."""
    x, y = windows(ids, L, ids.numel())  # every whole window
    if bos is not None:
        x, y = torch.cat([torch.full_like(x[:, :1], bos), x[:, :-1]], 1), x
    losses = []
    for xb, yb in zip(x.split(batch_size), y.split(batch_size)):
        logits = model(xb, window=L)  # window=L: full attention over all L, also past block_size
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), yb.flatten(), reduction="none").view(yb.shape))
    return torch.cat(losses)
