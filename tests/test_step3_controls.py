"""What keeps step 3 from ending worse than best-of-n (issue 21): answers scored as the
reward model was trained to read them, the per-update KL stop, the best-of-n baseline and
the export of the best evaluated policy. The adaptive KL controller's settling test sits
with the other RLHF math in test_algorithms.py."""

from __future__ import annotations

import copy
import math
import zlib

import pytest
import torch
from omegaconf import OmegaConf

from engine.config import OptimConfig
from engine.data_parallel import DataParallel, Share
from engine.errors import UserError
from engine.hybrid import HybridEngine
from engine.models import byte_tokenizer, load_causal_lm, load_reward_model, sequence_scores
from engine.parallel import frozen
from engine.runtime import Runtime
from engine.tracking import Tracker
from steps import ppo
from steps.algorithms import model_paths
from steps.config import RunConfig
from steps.rlhf import masked_sum, tilted_kl
from steps.scoring import (
    RewardEnsemble,
    RewardFunction,
    Rewards,
    RewardScorer,
    decode_rollouts,
)
from steps.tokenize import collate_prompts

CPU = Runtime(device=torch.device("cpu"), dtype=torch.float32)
PAD, EOS = 0, 2


def settings(**changes) -> ppo.Settings:
    return ppo.resolve(OmegaConf.merge(OmegaConf.structured(RunConfig), {"ppo": changes}))


def test_a_cut_off_answer_is_scored_as_if_it_ended_with_eos():
    """Step 2 trains the reward model to read its score at EOS; a rollout cut off at the
    length limit gets one appended before it is read, left padding and all."""
    tok = byte_tokenizer()
    reward = frozen(load_reward_model("tiny-llama", tok, seed=4), CPU)
    scorer = RewardScorer(reward, tok, tok, CPU.device)
    prompt, answer = tok("Q: 2+2")["input_ids"], tok(" 4 4 4", add_special_tokens=False)[
        "input_ids"]
    short = tok("Hi")["input_ids"]
    # row 0 cut off (no EOS), row 1 ended with EOS then padding; prompts left-padded
    rows = [prompt + answer, [PAD] * (len(prompt) - len(short)) + short + answer[:2] + [EOS]
            + [PAD] * (len(answer) - 3)]
    sequences = torch.tensor(rows)
    mask = (sequences != PAD).long()
    got = scorer(sequences, mask, len(prompt))
    for i, real in enumerate([prompt + answer + [EOS], short + answer[:2] + [EOS]]):
        want = sequence_scores(reward, torch.tensor([real]), torch.ones(1, len(real)))[0]
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=0)
    # read at the last token instead, the cut-off answer would score differently
    unread = sequence_scores(reward, torch.tensor([prompt + answer]),
                             torch.ones(1, len(prompt + answer)))[0]
    assert abs(float(unread - got[0])) > 1e-4


def test_a_reward_model_whose_eos_differs_reads_what_step_2_trained_it_on():
    """Actor and reward model share a vocabulary but not an EOS (a Qwen2.5-Instruct actor
    ending with <|im_end|>, a base reward model with <|endoftext|>): the actor's ids, EOS
    and all, were scored with the reward model's EOS appended after the actor's. The text
    is re-tokenized and ended with the reward model's EOS, as step 2 tokenized it."""
    tok = byte_tokenizer()
    other = copy.deepcopy(tok)
    other.eos_token = "<unk>"         # another token of the same vocabulary
    reward = frozen(load_reward_model("tiny-llama", other, seed=4), CPU)
    scorer = RewardScorer(reward, tok, other, CPU.device)
    assert scorer.same_vocabulary and not scorer.reads_actor_ids
    text = "Q: 2+2 A: 4"
    sequences = torch.tensor([tok(text)["input_ids"] + [EOS]])
    got = scorer(sequences, torch.ones_like(sequences), len(tok("Q: 2+2")["input_ids"]))
    trained_on = torch.tensor([other(text)["input_ids"] + [other.eos_token_id]])
    want = sequence_scores(reward, trained_on, torch.ones_like(trained_on))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def tiny_models(tok, lr: float = 1e-3, gold=None) -> ppo.Models:
    actor = HybridEngine(load_causal_lm("tiny-llama", tok, seed=1),
                         OptimConfig(lr_scheduler="constant", grad_clip=0), 100, CPU, lr=lr)
    reference = frozen(load_causal_lm("tiny-llama", tok, seed=1), CPU)
    reward = frozen(load_reward_model("tiny-llama", tok, seed=4), CPU)
    rewards = Rewards(tok, RewardScorer(reward, tok, tok, CPU.device), 1.0, None, 0.0)
    return ppo.Models(actor, None, reference, rewards, tok, None)


def experience(models: ppo.Models, s: ppo.Settings, rows: int = 8) -> ppo.Experience:
    prompts = [models.tokenizer(f"Q{i}:")["input_ids"] for i in range(rows)]
    batch = collate_prompts(prompts, PAD)
    exp, _ = ppo.make_experience(models, batch, s, DataParallel(CPU), kl_coef=0.0,
                                 seeds=ppo.row_seeds(0, 1, list(range(rows))))
    # strong, fixed advantages: every update moves the policy far
    return exp._replace(advantages=torch.where(exp.action_mask > 0, 5.0, 0.0))


def test_target_kl_stops_a_round_early():
    """Two passes of four micro-batches are 8 updates; with a tight target_kl the round
    stops at the first micro-batch that finds the policy moved past it, and says so."""
    tok = byte_tokenizer()
    runs = {}
    for target_kl in (None, 1e-3):
        torch.manual_seed(0)
        models = tiny_models(tok, lr=5e-2)
        s = settings(ppo_epochs=2, micro_batch_size=1, rollout_batch_size=4,
                     max_new_tokens=6, target_kl=target_kl)
        exp = experience(models, s, rows=4)
        share = Share(list(range(4)), list(range(4)), 1.0)
        stats, _ = ppo.update(exp, share, 4, models, s, DataParallel(CPU), [], 0, None, 0, 0.0)
        runs[target_kl] = (stats, models.actor.steps, float(exp.action_mask.sum()))
    (free, free_steps, tokens), (held, held_steps, _) = runs[None], runs[1e-3]
    assert free["train/updates"] == free_steps == 8 and free["stopped"] == 0.0
    assert held["stopped"] == 1.0 and 1 <= held["train/updates"] == held_steps < 8
    # the tokens trained on (time/train_tokens_per_s): both passes, or only those made
    assert free["trained_tokens"] == 2 * tokens
    assert 0 < held["trained_tokens"] < free["trained_tokens"]


def test_overlong_shaping_clip_higher_dual_clip_and_dr_grpo_reach_the_round(monkeypatch):
    """ppo.overlong_buffer lowers each answer's score (and its reward) by DAPO's penalty
    for its length; ppo.clip_range_high, ppo.dual_clip, GSPO's ratio and the Dr. GRPO
    aggregation reach the policy loss of every update."""
    tok = byte_tokenizer()
    torch.manual_seed(0)
    models = tiny_models(tok)
    plain = experience(models, settings(max_new_tokens=6, rollout_batch_size=4), rows=4)
    shaped = experience(models, settings(max_new_tokens=6, rollout_batch_size=4,
                                         overlong_buffer=4, overlong_penalty=2.0), rows=4)
    assert torch.equal(plain.sequences, shaped.sequences)
    lengths = plain.action_mask.sum(-1)
    want = 2.0 * ((lengths - 2) / 4).clamp(0, 1)
    assert want.max() > 0
    torch.testing.assert_close(plain.scores - shaped.scores, want)
    torch.testing.assert_close((plain.rewards - shaped.rewards).sum(-1), want)
    seen = []

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    real = ppo.policy_loss
    monkeypatch.setattr(ppo, "policy_loss", spy)
    s = settings(max_new_tokens=6, rollout_batch_size=4, micro_batch_size=4,
                 clip_range_high=0.28, dual_clip=3.0, loss_aggregation="seq-mean-token-sum-norm",
                 importance_ratio="sequence")
    share = Share(list(range(4)), list(range(4)), 1.0)
    ppo.update(plain, share, 4, models, s, DataParallel(CPU), [], 0, None, 0, 0.0)
    (args, kwargs), = seen
    assert args[4:8] == (0.2, 4.0, 0.28, 3.0)   # clip_range, answers, high, dual
    assert kwargs == {"sequence_ratio": True}
    torch.testing.assert_close(args[3], plain.action_mask / 6)
    # the statistics (ratio, KL from the sampling policy, clip fraction) stay means: each
    # answer's tokens weigh 1 / its length, not its length / 6 (target_kl reads the KL)
    lengths = plain.action_mask.sum(-1, keepdim=True)
    torch.testing.assert_close(args[8], plain.action_mask / lengths)


def test_best_of_n_equals_a_direct_computation():
    """For each prompt: sample n answers one by one, score each with the reward model
    (EOS appended where cut off) and the gold function, keep the reward model's favourite;
    the means must be ppo.best_of_n's, and its KL the analytic log n - (n-1)/n; the KL
    coefficient it reads from those answers holds the KL target."""
    tok, n = byte_tokenizer(), 4
    models = tiny_models(tok)
    gold = RewardFunction(lambda prompt, answer: float(answer.count("a")), "tests:gold",
                          "ppo.eval_reward_fn")
    s = settings(best_of_n=n, rollout_batch_size=4, max_new_tokens=8)._replace(gold=gold)
    prompt_ids = [tok(f"Say {w}:")["input_ids"] for w in ("a", "bb", "ccc")]
    prompts = ppo.Prompts([], prompt_ids, [], {})
    got = ppo.best_of_n(models, prompts, s, DataParallel(CPU))

    picked_rewards, picked_gold, all_rewards = [], [], []
    for i, prompt in enumerate(prompt_ids):
        candidates = []
        for j in range(n):
            seed = ppo.row_seeds(s.seed, ppo.BEST_OF_N_STREAM, [i * n + j])
            answer = ppo.rollout(models, collate_prompts([prompt], PAD), s.sampling, seed)
            reward = float(models.rewards(answer.sequences, answer.attention_mask,
                                          answer.prompt_len)[0])
            texts = decode_rollouts(tok, answer.sequences, answer.prompt_len)
            candidates.append((reward, gold.fn(texts[0][0], texts[1][0])))
        all_rewards += [reward for reward, _ in candidates]
        best = max(candidates, key=lambda c: c[0])
        picked_rewards.append(best[0])
        picked_gold.append(best[1])
    assert got["reward"] == pytest.approx(sum(picked_rewards) / 3, abs=1e-6)
    assert got["ground_truth"] == pytest.approx(sum(picked_gold) / 3, abs=1e-12)
    assert got["kl"] == pytest.approx(math.log(4) - 3 / 4, abs=1e-12)
    # a real selection: above the mean of all sampled answers by the reward model
    assert got["reward"] > sum(all_rewards) / len(all_rewards)
    # the coefficient whose reward-tilted optimum holds the KL target, from the same
    # answers: bisection on the exact mean KL (best_of_n interpolates on a grid)
    rewards = torch.tensor(all_rewards).view(3, n).clamp(-s.ppo.score_clip, s.ppo.score_clip)
    low, high = 1e-3, 1e3
    for _ in range(60):
        mid = math.sqrt(low * high)
        above = float(tilted_kl(rewards, torch.tensor([mid])).mean()) > s.kl_target
        low, high = (mid, high) if above else (low, mid)
    assert got["kl_coef_at_target"] == pytest.approx(low, rel=2e-2)


def test_evaluations_measure_the_kl_over_the_vocabulary_at_each_answer_token():
    """The evaluation's KL per answer, computed one unpadded answer at a time by hand: the
    same sampled answers (the evaluation's row seeds), then at each answer token, EOS
    included, sum_v p log(p / q) of the actor's and the reference's next-token
    distributions, summed over the answer and averaged over the prompts. It is not the
    sampled log-ratio (k1) of the same answers, which has three times the spread."""
    tok = byte_tokenizer()
    models = tiny_models(tok)._replace(
        reference=frozen(load_causal_lm("tiny-llama", tok, seed=3), CPU))
    s = settings(rollout_batch_size=2, max_new_tokens=8)
    prompt_ids = [tok(f"Say {w}:")["input_ids"] for w in ("a", "bb", "ccc")]
    got = ppo.evaluate(models, ppo.Prompts([], prompt_ids, [], {}), s, DataParallel(CPU))
    times = models.actor.take_times()   # sampled and greedy answers of 2 batches: one gather
    assert (times.calls, times.gathers) == (4, 1)

    full, sampled = [], []
    for i, prompt in enumerate(prompt_ids):
        seed = ppo.row_seeds(s.seed, ppo.EVAL_STREAM, [i])
        answer = ppo.rollout(models, collate_prompts([prompt], PAD), s.sampling, seed)
        n = int(answer.answered.sum())
        kls = kl_by_hand(models, answer.sequences[:, :len(prompt) + n], len(prompt))
        full.append(kls[0])
        sampled.append(kls[1])
    assert got["kl"] == pytest.approx(sum(full) / 3, abs=1e-5)
    assert abs(sum(full) - sum(sampled)) > 1e-3


def kl_by_hand(models: ppo.Models, sequence: torch.Tensor, prompt_len: int
               ) -> tuple[float, float]:
    """One unpadded answer [1, P + n] (EOS included): its KL over the vocabulary summed
    over the answer's tokens, sum_t sum_v p log(p / q), and its sampled log-ratio."""
    with torch.no_grad():
        log_p = models.actor(input_ids=sequence).logits[0, prompt_len - 1:-1].log_softmax(-1)
        log_q = models.reference(input_ids=sequence).logits[0, prompt_len - 1:-1
                                                            ].log_softmax(-1)
    taken = sequence[0, prompt_len:, None]
    return (float((log_p.exp() * (log_p - log_q)).sum()),
            float((log_p.gather(-1, taken) - log_q.gather(-1, taken)).sum()))


@pytest.mark.parametrize("controller", [True, False])
def test_the_kl_controller_reads_the_rollouts_kl_over_the_vocabulary(controller):
    """With the adaptive controller on, the experience holds each answer token's KL over
    the vocabulary, and the round's mean per answer is logged as reward/kl_vocab (what
    the controller reads), each answer's equal to the one computed by hand; with the
    controller off there is nothing to read and nothing is computed."""
    tok = byte_tokenizer()
    models = tiny_models(tok)._replace(
        reference=frozen(load_causal_lm("tiny-llama", tok, seed=3), CPU))
    s = settings(rollout_batch_size=3, max_new_tokens=8, kl_target=1.0 if controller else 0)
    prompt_ids = [tok(f"Say {w}:")["input_ids"] for w in ("a", "bb", "ccc")]
    exp, _ = ppo.make_experience(models, collate_prompts(prompt_ids, PAD), s, DataParallel(CPU),
                                 kl_coef=0.1, seeds=ppo.row_seeds(0, 1, [0, 1, 2]))
    metrics = ppo._rollout_metrics(exp, tok.eos_token_id, s.kl_target is not None,
                                   DataParallel(CPU))
    if not controller:
        assert not exp.vocab_kl.any() and "reward/kl_vocab" not in metrics
        return
    full = []
    for i, prompt in enumerate(prompt_ids):
        p, n = exp.prompt_len, int(exp.action_mask[i].sum())
        full.append(kl_by_hand(models, exp.sequences[i:i + 1, p - len(prompt):p + n],
                               len(prompt))[0])
        assert float((exp.vocab_kl[i] * exp.action_mask[i]).sum()) == pytest.approx(full[-1],
                                                                                    abs=1e-5)
    assert metrics["reward/kl_vocab"] == pytest.approx(sum(full) / 3, abs=1e-5)
    assert metrics["reward/kl_vocab"] != pytest.approx(metrics["reward/kl"], abs=1e-3)


def test_export_best_writes_the_peak_not_the_last_policy(tmp_path):
    """Evaluations whose gold score rises, peaks and falls: the weights kept are the
    peak's, and the export writes them, not the live (last) ones; a policy over the KL
    budget is never kept, however good its score."""
    tok = byte_tokenizer()
    models = tiny_models(tok)
    actor, s = models.actor, settings(export="best", kl_budget=1.0)
    kept = ppo.Kept(None, actor.copy_weights(trainable_only=True))
    state = ppo.Progress(best={"reward": 0.0, "ground_truth": 0.2, "kl": 0.0, "iteration": 0})
    snapshots = {}
    for iteration, (gold, kl) in enumerate([(0.5, 0.5), (0.9, 0.8), (0.95, 3.0), (0.4, 0.9)],
                                           start=1):
        with torch.no_grad():   # stands in for an update
            for p in actor.parameters():
                p.add_(0.01 * iteration)
        snapshots[iteration] = {k: v.clone() for k, v in actor.copy_weights().tensors.items()}
        state = ppo.keep_if_best(state._replace(iteration=iteration),
                                 {"reward": 0.0, "ground_truth": gold, "kl": kl}, s, kept, actor)
    assert state.best["iteration"] == 2 and state.best["ground_truth"] == 0.9
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {"output_dir": str(tmp_path)})
    ppo.export(cfg, models, kept, True, DataParallel(CPU))
    exported = load_causal_lm(str(tmp_path / "step3" / "actor"), tok)
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, snapshots[2][name], atol=0, rtol=0)
    live = dict(actor.copy_weights().tensors)
    assert all(torch.equal(live[k], snapshots[4][k]) for k in live)   # live ones untouched


@pytest.mark.parametrize("floor", [True, False])
def test_export_best_keeps_no_policy_whose_greedy_answers_fall_below_the_sft_models(floor):
    """ppo.greedy_floor: a higher sampled gold score does not make a policy better when its
    greedy answers' gold score fell below the SFT policy's; such evaluations are counted.
    Without the floor the sampled gold score alone ranks them."""
    tok = byte_tokenizer()
    actor = tiny_models(tok).actor
    s = settings(export="best", kl_budget=1.0, greedy_floor=floor,
                 eval_reward_fn="steps.demo:score")
    kept = ppo.Kept(None, actor.copy_weights(trainable_only=True))
    sft = {"reward": 0.0, "ground_truth": 0.4, "greedy_ground_truth": 0.6, "kl": 0.0}
    state = ppo.Progress(before=sft, best={**sft, "iteration": 0})
    for iteration, (gold, greedy) in enumerate([(0.5, 0.6), (0.7, 0.5), (0.55, 0.65)], start=1):
        state = ppo.keep_if_best(state._replace(iteration=iteration),
                                 {"reward": 0.0, "ground_truth": gold,
                                  "greedy_ground_truth": greedy, "kl": 0.5}, s, kept, actor)
    assert state.best["iteration"] == (3 if floor else 2)
    assert state.floored == (1 if floor else 0)
    assert s.greedy_floor == floor
    assert not settings(greedy_floor=True).greedy_floor   # without a gold score: no floor


def test_export_best_without_eval_prompts_is_refused_or_falls_back_to_the_last_policy():
    """Export=best ranks evaluations; with no eval prompts (ppo.eval_prompts=0, or all too
    long) there are none, and it would export the SFT weights kept at the start: asked for
    by name it is refused, under auto the last policy is exported."""
    with pytest.raises(UserError, match="ppo.export=best .* no eval prompts"):
        ppo.with_evaluations(settings(export="best"), eval_prompts=0)
    auto = settings(export="auto", eval_reward_fn="steps.demo:score")
    assert auto.export_best and auto.greedy_floor
    fallen = ppo.with_evaluations(auto, eval_prompts=0)
    assert not fallen.export_best and not fallen.greedy_floor
    assert ppo.with_evaluations(auto, eval_prompts=3) == auto


@pytest.mark.parametrize("best_of_n, budget", [(8, math.log(8) - 7 / 8), (4, math.log(4) - 3 / 4),
                                               (0, math.log(8) - 7 / 8)])
def test_the_kl_budget_and_target_default_from_best_of_n_also_without_the_baseline(best_of_n,
                                                                                   budget):
    """The default budget is best-of-n's KL; with the baseline off (best_of_n=0) it is
    best-of-8's, so turning the baseline off leaves the KL controller on (it used to turn
    it off: a GRPO demo run drifted to 6.5 nats)."""
    s = settings(best_of_n=best_of_n)
    assert s.kl_budget == pytest.approx(budget)
    assert s.kl_target == pytest.approx(0.9 * budget)
    assert settings(best_of_n=0, kl_budget=2.0).kl_target == pytest.approx(1.8)
    assert settings(best_of_n=0, kl_target=0).kl_target is None     # 0: off, as documented


def test_a_kl_coefficient_of_zero_turns_the_controller_off():
    """kl_coef is the controller's start and floor: at 0 (no KL penalty asked for) the
    controller, which works on the log coefficient, is off rather than started at log 0."""
    assert settings(kl_coef=0.0).kl_target is None
    assert settings(kl_coef=0.0, kl_target=1.0).kl_target is None
    assert settings(kl_coef=0.05).kl_target == pytest.approx(0.9 * (math.log(8) - 7 / 8))


def test_the_kl_controller_starts_at_the_baselines_coefficient_and_keeps_it_until_the_target():
    """best_of_n's coefficient (whose tilted optimum holds the target) is where the adaptive
    controller starts, and its floor while the KL grows from 0 towards the target; once
    the KL reaches the target the controller answers it, down to ppo.kl_coef."""
    s = settings(kl_coef=0.05)                       # target 0.9 x 1.204 nats
    state = ppo.start_kl_coef(ppo.Progress(kl_coef=0.05), 0.4, s)
    assert (state.kl_coef, state.kl_floor) == (0.4, 0.4)
    for kl in (0.0, 0.3, 0.6):                       # below the target: held at the start
        state = ppo.next_kl_coef(state, kl, 32, s)
        assert state.kl_coef == pytest.approx(0.4)
    state = ppo.next_kl_coef(state, 2.0, 32, s)      # past it: raised at once
    assert state.kl_coef > 0.4 and state.kl_floor is None
    for reading in (math.nan, math.inf):             # a reading that says nothing: held
        assert ppo.next_kl_coef(state, reading, 32, s) == state
    for _ in range(200):
        state = ppo.next_kl_coef(state, 0.0, 32, s)
    assert state.kl_coef == pytest.approx(0.05)      # and free to fall to ppo.kl_coef
    # a policy that never reaches the target: the start holds KL_START_HORIZONS horizons
    state = ppo.start_kl_coef(ppo.Progress(kl_coef=0.05), 0.4, s)
    rounds = math.ceil(ppo.KL_START_HORIZONS * s.kl_horizon / 32)
    for iteration in range(rounds):
        assert state.kl_floor == 0.4
        state = ppo.next_kl_coef(state._replace(iteration=iteration), 0.5, 32, s)
    assert state.kl_floor is None
    state = ppo.next_kl_coef(state._replace(iteration=rounds), 0.5, 32, s)
    assert state.kl_coef < 0.4                       # lowered towards the target
    # never below ppo.kl_coef; and not where the KL is a loss term (GRPO's other scale)
    assert ppo.start_kl_coef(ppo.Progress(kl_coef=0.05), 0.01, s).kl_coef == 0.05
    grpo = settings(kl_coef=0.05, algorithm="grpo", samples_per_prompt=4)
    assert ppo.start_kl_coef(ppo.Progress(kl_coef=0.05), 0.4, grpo).kl_coef == 0.05


def test_a_missing_model_is_named_by_whose_path_it_is(tmp_path, monkeypatch):
    """The default paths (a step not run yet) say to run it; a path the user gave that
    holds no model, or a model's config without its weights, says so, rather than to run a
    step that would not write there."""
    def paths(**ppo_keys):
        return model_paths(OmegaConf.merge(OmegaConf.structured(RunConfig), {
            "output_dir": str(tmp_path), "ppo": ppo_keys}))

    with pytest.raises(UserError, match=r"step 3 needs the step-1 actor at .*: run its step"):
        paths()
    with pytest.raises(UserError, match=rf"^ppo.critic_path={tmp_path}: no config.json"):
        paths(actor_path="tiny-llama", reward_model_weight=0, critic_path=str(tmp_path))
    # ~ as the loader reads it (a model there was refused), and an unknown ~user refused
    # in one line (it raised from expanduser)
    (tmp_path / "home" / "critic").mkdir(parents=True)
    (tmp_path / "home" / "critic" / "config.json").write_text("{}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    # a config.json alone (a copy broken off) is refused before steps 1 and 2 run
    with pytest.raises(UserError) as err:
        paths(actor_path="tiny-llama", reward_model_weight=0, critic_path="~/critic")
    assert str(err.value) == ("ppo.critic_path=~/critic: the directory has config.json but no "
                              "weights (one of model.safetensors, model.safetensors.index.json, "
                              "pytorch_model.bin, pytorch_model.bin.index.json); copy the whole "
                              "model, or save it again with save_pretrained")
    (tmp_path / "home" / "critic" / "model-00001-of-00002.safetensors").touch()
    paths(actor_path="tiny-llama", reward_model_weight=0, critic_path="~/critic")
    with pytest.raises(UserError, match=r"^ppo.critic_path=~nosuchuser/c: no config.json"):
        paths(actor_path="tiny-llama", reward_model_weight=0, critic_path="~nosuchuser/c")


def test_normalize_reward_finds_its_statistics_missing_before_step_1(tmp_path):
    """ppo.normalize_reward=true: a reward model on disk without score statistics, or a
    step 2 of this run that holds no pairs out to take them from, is refused before any
    step runs; step 2's own reward model, and one that has them, pass."""
    def paths(made=(), **keys):
        return model_paths(OmegaConf.merge(OmegaConf.structured(RunConfig), {
            "output_dir": str(tmp_path), **keys}), made)

    tok = byte_tokenizer()
    reward = load_reward_model("tiny-llama", tok)
    reward.save_pretrained(tmp_path / "rm")
    with pytest.raises(UserError, match=rf"^ppo.normalize_reward=true: the reward model "
                                        rf"ppo.reward_path {tmp_path}/rm has no score "
                                        r"statistics in its config.json"):
        paths(ppo={"actor_path": "tiny-llama", "reward_path": str(tmp_path / "rm"),
                   "normalize_reward": True})
    paths(ppo={"actor_path": "tiny-llama", "reward_path": str(tmp_path / "rm")})   # not asked
    reward.config.update({"score_mean": 0.1, "score_std": 2.0})
    reward.save_pretrained(tmp_path / "rm")
    paths(ppo={"actor_path": "tiny-llama", "reward_path": str(tmp_path / "rm"),
               "normalize_reward": True})
    # step 2 of this run writes them from its held-out pairs: none held out, none written
    with pytest.raises(UserError, match=r"data.eval_fraction=0 holds none out: give "
                                        r"data.eval_fraction > 0"):
        paths((1, 2), ppo={"normalize_reward": True}, data={"eval_fraction": 0.0})
    paths((1, 2), ppo={"normalize_reward": True})


def test_extra_reward_paths_are_checked_before_step_1(tmp_path):
    """Each of ppo.extra_reward_paths must hold a model (a preset is no reward model), and
    with ppo.normalize_reward its statistics, named by its index."""
    def paths(**ppo_keys):
        return model_paths(OmegaConf.merge(OmegaConf.structured(RunConfig), {
            "output_dir": str(tmp_path), "ppo": {"actor_path": "tiny-llama",
                                                  "reward_path": str(tmp_path / "rm"),
                                                  **ppo_keys}}))

    tok = byte_tokenizer()
    load_reward_model("tiny-llama", tok).save_pretrained(tmp_path / "rm")
    for bad in (str(tmp_path / "none"), "tiny-llama"):
        with pytest.raises(UserError, match=rf"^ppo.extra_reward_paths\[1\]={bad}: no "
                                            r"config.json there"):
            paths(extra_reward_paths=[str(tmp_path / "rm"), bad])
    paths(extra_reward_paths=[str(tmp_path / "rm")])
    reward = load_reward_model("tiny-llama", tok)
    reward.config.update({"score_mean": 0.0, "score_std": 1.0})
    reward.save_pretrained(tmp_path / "rm")   # statistics for ppo.reward_path, none for plain
    load_reward_model("tiny-llama", tok).save_pretrained(tmp_path / "plain")
    with pytest.raises(UserError, match=r"^ppo.normalize_reward=true: the reward model "
                                        r"ppo.extra_reward_paths\[0\] .* has no score"):
        paths(extra_reward_paths=[str(tmp_path / "plain")], normalize_reward=True)
    paths(extra_reward_paths=[str(tmp_path / "rm")], normalize_reward=True)


def test_a_preset_actor_in_step_3_gets_the_runs_tokenizer(opt_tokenizer_path, tmp_path):
    """tokenizer=DIR gives presets a real tokenizer in steps 1 and 2; step 3 gave a preset
    actor the byte tokenizer, so its answers no longer matched a reward model trained with
    DIR. A model directory keeps its own tokenizer."""
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {"tokenizer": str(opt_tokenizer_path)})
    assert len(ppo.model_tokenizer(cfg, "tiny-llama", "ppo.actor_path")) == 50265
    tok = byte_tokenizer()
    load_causal_lm("tiny-llama", tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert len(ppo.model_tokenizer(cfg, str(tmp_path), "ppo.actor_path")) == len(tok)


def _same_or_checksum(prompt: str, answer: str) -> float:
    """A rule reward: 1 for a prompt saying "same" whatever the answer (a group that
    teaches nothing), else a checksum of the answer in [0, 1) (answers that differ score
    apart, within ppo.score_clip)."""
    return 1.0 if "same" in prompt else zlib.crc32(answer.encode()) % 1000 / 1000


def rule_models(tok) -> ppo.Models:
    models = tiny_models(tok)
    fn = RewardFunction(_same_or_checksum, "tests:same_or_checksum")
    return models._replace(rewards=Rewards(tok, None, 0.0, fn, 1.0))


def dynamic(**changes) -> ppo.Settings:
    return settings(algorithm="grpo", samples_per_prompt=3, rollout_batch_size=3,
                    micro_batch_size=3, max_new_tokens=6, dynamic_sampling=True, **changes)


def test_an_evaluation_shows_its_first_greedy_answers_with_the_scores_it_averaged():
    """ppo.log_answers (answers.jsonl): an evaluation's first greedy answers, the texts
    chat.py would answer, each with the reward and gold score it got; over all the eval
    prompts, their means are the evaluation's greedy_reward and greedy_ground_truth."""
    tok, dp = byte_tokenizer(), DataParallel(CPU)
    torch.manual_seed(0)
    models = rule_models(tok)
    texts = ["Q1:", "same a:", "Q22:"]
    prompt_ids = [tok(t)["input_ids"] for t in texts]
    eval_prompts = ppo.Prompts([], prompt_ids, [], {})

    def evaluated(log_answers: int) -> tuple[dict, list[dict]]:
        s = settings(rollout_batch_size=4, max_new_tokens=6, log_answers=log_answers)
        s = s._replace(gold=RewardFunction(lambda prompt, answer: float(len(answer)), "len"))
        shown: list[dict] = []
        return ppo.evaluate(models, eval_prompts, s, dp, shown), shown

    got, shown = evaluated(3)
    greedy = ppo.rollout(models, collate_prompts(prompt_ids, PAD),
                         settings(max_new_tokens=6).greedy, None)
    assert [(row["prompt"], row["answer"]) for row in shown] == list(zip(
        *decode_rollouts(tok, greedy.sequences, greedy.prompt_len), strict=True))
    assert [row["prompt"] for row in shown] == texts
    for row in shown:
        assert row["reward"] == pytest.approx(_same_or_checksum(row["prompt"], row["answer"]))
        assert row["ground_truth"] == len(row["answer"])
    assert got["greedy_reward"] == pytest.approx(sum(r["reward"] for r in shown) / 3)
    assert got["greedy_ground_truth"] == pytest.approx(sum(r["ground_truth"] for r in shown) / 3)
    again, first = evaluated(1)
    assert first == shown[:1] and again == got   # what is shown changes no figure
    assert evaluated(0)[1] == []


def test_an_evaluation_measures_a_reward_ensembles_disagreement_on_its_sampled_answers():
    """eval/reward_disagreement: the mean over the sampled eval answers of the std of the
    ensemble's scores; here one model scores an answer by the sum of its token ids / 100,
    the other 1 (less than any here), so the std is half their difference. A single reward
    model has none to report."""
    tok, dp = byte_tokenizer(), DataParallel(CPU)
    torch.manual_seed(0)
    models = rule_models(tok)
    prompt_ids = [tok(t)["input_ids"] for t in ["Q1:", "same a:", "Q22:"]]
    eval_prompts = ppo.Prompts([], prompt_ids, [], {})

    def id_sum(sequences, attention_mask, prompt_len):
        return (sequences * attention_mask)[:, prompt_len:].sum(-1).float() / 100

    ensemble = RewardEnsemble([id_sum, lambda *rollout: torch.ones(len(rollout[0]))])
    s = settings(rollout_batch_size=2, max_new_tokens=6, temperature=1.0)
    got = ppo.evaluate(models._replace(rewards=Rewards(tok, ensemble, 1.0, None, 0.0)),
                       eval_prompts, s, dp)
    sampled = ppo.rollout(models, collate_prompts(prompt_ids, PAD), s.sampling,
                          ppo.row_seeds(s.seed, ppo.EVAL_STREAM, [0, 1, 2]))
    scores = id_sum(sampled.sequences, sampled.attention_mask, sampled.prompt_len)
    assert len(set(scores.tolist())) == 3 and bool((scores > 1).all())   # answers that differ
    assert got["reward_disagreement"] == pytest.approx(float(scores.mean() - 1) / 2)
    assert got["reward"] == pytest.approx(float(scores.mean() + 1) / 2)   # their mean
    assert "reward_disagreement" not in ppo.evaluate(models, eval_prompts, s, dp)


def test_dynamic_sampling_draws_until_enough_prompts_differ_and_keeps_the_first():
    """Batches are drawn until 3 prompts' answers differ: the first batch has one, the
    second two more (and one past the target), the third is never drawn. The batch
    trained on holds those prompts' answers in order, as each draw sampled them (the
    second with row seeds of its own), left-padded to the longest prompt: its log-probs
    and advantages are each round's own."""
    tok, dp = byte_tokenizer(), DataParallel(CPU)
    torch.manual_seed(0)
    models, s = rule_models(tok), dynamic()
    texts = [["same a:", "Q1:", "same b:"], ["Q2:", "Q3:", "Q4:"], ["Q5:", "Q6:", "Q7:"]]
    batches = [[tok(t)["input_ids"] for t in batch] for batch in texts]
    rest = iter(batches[1:])
    models.actor.take_times()
    got = ppo.sample_informative(models, batches[0], lambda: next(rest, None), s, dp, stream=1)
    assert next(rest) == batches[2]   # not drawn
    times = models.actor.take_times()
    assert (times.calls, times.gathers) == (2, 1)   # the draws share one gather
    alone = [ppo.sample_round(models, batch, s, dp, stream=1, first_row=9 * i)
             for i, batch in enumerate(batches[:2])]
    everything = torch.cat([r.sampled.scores for r in alone])
    assert got.counts == {"sampling/draws": 2, "sampling/prompts_kept": 3,
                          "sampling/prompts_uniform": 2, "sampling/prompts_surplus": 1,
                          "sampling/score": pytest.approx(float(everything.mean())),
                          "sampling/answer_tokens": sum(float(r.sampled.answers.answered.sum())
                                                        for r in alone)}
    assert (got.size, got.drawn, got.share.index, got.share.weight) == (9, 18, list(range(9)), 1.0)
    rows = [(0, torch.arange(3, 6)), (1, torch.arange(0, 3)), (1, torch.arange(3, 6))]
    want = [alone[draw].sampled.rows(index) for draw, index in rows]   # Q1, Q2, Q3
    sampled = got.sampled
    prompts, answers = decode_rollouts(tok, sampled.answers.sequences, sampled.answers.prompt_len)
    assert prompts[::3] == ["Q1:", "Q2:", "Q3:"]
    assert answers == [a for w in want for a in decode_rollouts(tok, w.answers.sequences,
                                                                w.answers.prompt_len)[1]]
    assert torch.equal(sampled.scores, torch.cat([w.scores for w in want]))
    assert alone[1].sampled.answers.prompt_len < sampled.answers.prompt_len   # padded more
    exp = ppo.experience_of(models, sampled, s, dp, kl_coef=0.0)
    own = [ppo.experience_of(models, w, s, dp, kl_coef=0.0) for w in want]
    for name in ("logprobs", "ref_logprobs", "advantages", "action_mask"):
        whole = getattr(exp, name).view(3, 3, -1)
        for i, part in enumerate(own):
            width = getattr(part, name).shape[1]
            torch.testing.assert_close(whole[i, :, :width], getattr(part, name), atol=1e-5,
                                       rtol=1e-5, msg=name)
    assert exp.advantages.abs().sum(1).gt(0).all()   # every kept answer has a signal


def test_dynamic_sampling_that_finds_nothing_to_learn_trains_nothing():
    """ppo.dynamic_sampling_max_draws batches whose answers all score the same: a stand-in
    of weight 0 and a batch of 0 answers, on which the update makes no step."""
    tok, dp = byte_tokenizer(), DataParallel(CPU)
    torch.manual_seed(0)
    models, s = rule_models(tok), dynamic(dynamic_sampling_max_draws=2)
    batches = [[tok(f"same {i}{j}:")["input_ids"] for j in range(3)] for i in range(3)]
    rest = iter(batches[1:])
    got = ppo.sample_informative(models, batches[0], lambda: next(rest, None), s, dp, stream=1)
    assert next(rest) == batches[2]   # the draws' limit
    assert (got.size, got.drawn, got.share, got.sampled.weight) == (0, 18, Share([], [0], 0.0),
                                                                   0.0)
    assert got.counts["sampling/prompts_uniform"] == 6 and got.counts["sampling/draws"] == 2
    exp = ppo.experience_of(models, got.sampled, s, dp, kl_coef=0.0)
    assert not exp.action_mask.any()
    stats, _ = ppo.update(exp, got.share, got.size, models, s, dp, [], 0, None, 0, 0.0)
    assert stats["train/updates"] == 0 and models.actor.steps == 0
    # no answer kept: no score or length means logged as zeros
    assert ppo._rollout_metrics(exp, tok.eos_token_id, True, dp) == {"answer/tokens": 0.0}


@pytest.mark.parametrize("target_kl", [None, 0.0])
def test_the_learning_rate_schedule_moves_with_the_prompt_batches_drawn(tmp_path, target_kl):
    """Linear decay planned over 2 rounds of 3 updates. One iteration draws both rounds
    (dynamic sampling: the first batch teaches nothing) and makes 3 updates, or with
    ppo.target_kl=0 one (it stops the round after its first): either way the schedule has
    run out, as the data has. Counted by optimizer steps it would stand half-way or more,
    and the run would end at a learning rate it never decayed from."""
    tok, dp = byte_tokenizer(), DataParallel(CPU)
    torch.manual_seed(0)
    models, s = rule_models(tok), dynamic(target_kl=target_kl)
    per_round = ppo.updates_per_round(s.ppo)
    assert per_round == 3
    actor = HybridEngine(load_causal_lm("tiny-llama", tok, seed=1),
                         OptimConfig(lr_scheduler="linear", grad_clip=0), 2 * per_round, CPU,
                         lr=1e-3)
    models = models._replace(actor=actor)
    batches = [[tok(t)["input_ids"] for t in texts]
               for texts in (["same a:", "same b:", "same c:"], ["Q1:", "Q2:", "Q3:"])]
    rest = iter(batches[1:])
    prompts = ppo.Prompts([p for b in batches for p in b], [], [], {})
    state, _ = ppo.iterate(s, models, prompts, batches[0], ppo.Kept(None, None), dp,
                           Tracker(tmp_path, enabled=False), ppo.Progress(kl_coef=s.ppo.kl_coef),
                           more=lambda: next(rest, None))
    assert actor.steps == (3 if target_kl is None else 1)
    assert actor.scheduler.last_epoch == 2 * per_round and actor.lr == 0.0
    assert state.kl_stops == (target_kl is not None)


@pytest.mark.parametrize("kl_target", [None, 0.5])   # the experience's two forward paths
def test_the_entropy_bonus_raises_the_policys_entropy_and_is_logged(kl_target):
    """With no advantage to follow, an update moves the policy only through ppo.entropy_coef:
    its entropy rises, and train/entropy (the policy's at the update, before its step) is
    the experience's policy/entropy. Without the bonus the update leaves it as it was."""
    tok, dp = byte_tokenizer(), DataParallel(CPU)
    entropies = {}
    for coef in (0.0, 1.0):
        torch.manual_seed(0)
        models = tiny_models(tok, lr=1e-4)
        s = settings(rollout_batch_size=4, micro_batch_size=4, max_new_tokens=6,
                     entropy_coef=coef, kl_target=kl_target, kl_coef=0.0 if kl_target is None
                     else 0.1)
        exp = experience(models, s, rows=4)._replace(advantages=torch.zeros(4, 6))
        before = float(masked_sum(exp.entropy, exp.action_mask) / exp.action_mask.sum())
        share = Share(list(range(4)), list(range(4)), 1.0)
        stats, _ = ppo.update(exp, share, 4, models, s, dp, [], 0, None, 0, 0.0)
        after = ppo.experience_of(models, ppo.Sampled(ppo.Rollout(exp.sequences,
                                                                 exp.attention_mask,
                                                                 exp.action_mask),
                                                       exp.scores, None, 1.0), s, dp,
                                  kl_coef=0.0)
        entropies[coef] = float(masked_sum(after.entropy, after.action_mask)
                                / after.action_mask.sum())
        if coef:
            assert stats["train/entropy"] == pytest.approx(before, rel=1e-5)
        else:
            assert "train/entropy" not in stats
            assert entropies[coef] == pytest.approx(before, abs=1e-6)
    assert entropies[1.0] > entropies[0.0] + 1e-3
