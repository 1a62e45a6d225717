"""The unit of a validation loss: per byte (moebit's GPT, or a Hugging Face model trained on
raw bytes) or per token of a named tokenizer, with bits per byte beside it for comparison.

A tokenized run's loss is a mean over tokens, so "nats/byte" would be wrong and two
tokenizers' losses are not comparable. Bits per byte are: loss per token times tokens per
byte of the validation text, over ln 2. The train loop, ``moebit eval`` and ``moebit
report`` all say the unit this way, from the fields ``loss_unit`` adds to a record.

    rec.update(loss_unit(val_bytes=len(raw.val), val_ids=len(ids.val), tokenizer="hf/tokenizer.json"))
    loss_text(rec["val_loss"], rec)   # '2.1034 nats/token of hf/tokenizer.json (1.012 bits/byte)'
"""

from __future__ import annotations

import math
from typing import Any


def loss_unit(val_bytes: int, val_ids: int, tokenizer: str | None) -> dict[str, Any]:
    """The record fields naming the unit: ``loss_unit`` ("byte" or "token"), and for
    tokens the ``tokenizer`` and the validation text's ``tokens_per_byte``."""
    if tokenizer is None:
        return {"loss_unit": "byte"}
    return {"loss_unit": "token", "tokenizer": str(tokenizer),
            "tokens_per_byte": val_ids / val_bytes if val_bytes else None}


def unit_name(rec: dict[str, Any]) -> str:
    """"nats/byte" or "nats/token" (a record without the fields is a byte-level run)."""
    return "nats/token" if rec.get("loss_unit") == "token" else "nats/byte"


def bits_per_byte(val_loss: float, rec: dict[str, Any]) -> float | None:
    """The loss in bits per byte of text; None where the tokens per byte are unknown."""
    if rec.get("loss_unit") != "token":
        return val_loss / math.log(2)
    tpb = rec.get("tokens_per_byte")
    return val_loss * tpb / math.log(2) if tpb else None


def loss_text(val_loss: float, rec: dict[str, Any]) -> str:
    """'1.2345 nats/byte (1.781 bits/byte)' or '2.1034 nats/token of TOKENIZER (...)'."""
    bpb = bits_per_byte(val_loss, rec)
    tail = f" ({bpb:.3f} bits/byte)" if bpb is not None else ""
    if rec.get("loss_unit") == "token":
        return f"{val_loss:.4f} nats/token of {rec.get('tokenizer', '?')}{tail}"
    return f"{val_loss:.4f} nats/byte{tail}"
