"""Reward-model scores equal transformers' *ForSequenceClassification on a tiny random model."""

import numpy as np
import pytest
from tiny_models import make_char_tokenizer

torch = pytest.importorskip("torch")

from jaxrl_llm.hf import load_hf_folder  # noqa: E402
from jaxrl_llm.roles.reward_model import RewardModel  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def hf_rm(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         num_labels=1, pad_token_id=0, rope_theta=5000.0)
    model = LlamaForSequenceClassification(config).eval()
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)  # O(1) scores so the tolerance means something
    folder = tmp_path_factory.mktemp("rm")
    model.save_pretrained(folder)
    return model, folder


def hf_scores(model, rows):
    """HF scores of unpadded rows, one at a time (no padding ambiguity)."""
    with torch.no_grad():
        return np.array([model(torch.tensor([r])).logits[0, 0].item() for r in rows], np.float32)


def test_score_tokens_matches_transformers(hf_rm):
    model, folder = hf_rm
    cfg, params = load_hf_folder(folder, head="score")
    tok = make_char_tokenizer(CHATML)
    rm = RewardModel(cfg, params, tok, micro_batch_size=2)
    rng = np.random.default_rng(0)
    rows = [rng.integers(4, 128, size=n).tolist() for n in (5, 17, 9)]
    # left-padded prompt part + right-padded response part, as the trainer holds them
    p, r = 8, 16
    prompt_ids = np.zeros((3, p), np.int32)
    prompt_mask = np.zeros((3, p), np.int32)
    response_ids = np.zeros((3, r), np.int32)
    response_mask = np.zeros((3, r), np.int32)
    for i, row in enumerate(rows):
        head, tail = row[:min(4, len(row))], row[min(4, len(row)):]
        prompt_ids[i, p - len(head):], prompt_mask[i, p - len(head):] = head, 1
        response_ids[i, :len(tail)], response_mask[i, :len(tail)] = tail, 1
    got = rm.score(prompt_ids, prompt_mask, response_ids, response_mask)
    want = hf_scores(model, rows)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_retemplated_scores_match_transformers(hf_rm):
    model, folder = hf_rm
    cfg, params = load_hf_folder(folder, head="score")
    policy_tok, rm_tok = make_char_tokenizer(CHATML), make_char_tokenizer(PLAIN)
    rm = RewardModel(cfg, params, rm_tok, input_tokenizer=policy_tok, max_length=40)
    assert rm.retokenize
    chats = [[{"role": "user", "content": "1+2?"}], "Say hi", [{"role": "user", "content": "x" * 50}]]
    responses = ["3", "hi there", "y"]
    prompt_texts = [policy_tok.apply_chat_template([{"role": "user", "content": c}] if isinstance(c, str) else c,
                                                   add_generation_prompt=True, tokenize=False) for c in chats]
    prompt_rows = [policy_tok(t, add_special_tokens=False)["input_ids"] for t in prompt_texts]
    response_rows = [policy_tok(r + "<|im_end|>", add_special_tokens=False)["input_ids"] for r in responses]
    p, r = max(map(len, prompt_rows)), 16
    prompt_ids = np.zeros((3, p), np.int32)
    prompt_mask = np.zeros((3, p), np.int32)
    response_ids = np.zeros((3, r), np.int32)
    response_mask = np.zeros((3, r), np.int32)
    for i, (pr, rr) in enumerate(zip(prompt_rows, response_rows)):
        prompt_ids[i, p - len(pr):], prompt_mask[i, p - len(pr):] = pr, 1
        response_ids[i, :len(rr)], response_mask[i, :len(rr)] = rr, 1
    got = rm.score(prompt_ids, prompt_mask, response_ids, response_mask, raw_prompts=chats)
    texts = [rm_tok.apply_chat_template(([{"role": "user", "content": c}] if isinstance(c, str) else c)
                                        + [{"role": "assistant", "content": resp}], tokenize=False)
             for c, resp in zip(chats, responses)]
    assert texts[1] == "USER: Say hi\nASSISTANT: hi there\n"
    rows = [rm_tok(t, add_special_tokens=False)["input_ids"][:40] for t in texts]
    assert len(rows[2]) == 40  # the long chat is right-truncated to max_length
    np.testing.assert_allclose(got, hf_scores(model, rows), atol=1e-4)
    with pytest.raises(ValueError, match="return_raw_chat"):
        rm.score(prompt_ids, prompt_mask, response_ids, response_mask)


def test_load_from_spec(hf_rm):
    from jaxrl_llm.rewards import RewardModelSpec

    model, folder = hf_rm
    tok = make_char_tokenizer(CHATML)
    tok.save_pretrained(folder)
    rm = RewardModel.load(RewardModelSpec(str(folder), None, None, None), tok)
    assert not rm.retokenize
    ids = np.array([[5, 6, 7, 8]], np.int32)
    np.testing.assert_allclose(rm.score_tokens(ids, np.ones_like(ids)), hf_scores(model, ids.tolist()), atol=1e-4)
