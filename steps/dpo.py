"""Step 3 by direct preference optimisation (ppo.algorithm=dpo; Rafailov et al., 2023): the
step-1 actor trained offline on step 3's share of the preference pairs, against itself
frozen as the reference (or without one: SimPO, ORPO; KTO reads each pair as a desirable
and an undesirable answer, or trains on unpaired feedback, data.feedback_path's records
of one answer and its label), with no reward model and no sampling. The reference's
log-probs of every pair are computed once, before the first update (TRL's
precompute_ref_log_probs); the reference is kept after that only to measure the KL of the
evaluations' sampled answers (dpo.eval_prompts). Judged by held-out implicit-reward
accuracy and, where there is a ground truth (ppo.eval_reward_fn, or the demo's), by the
sampled and greedy answers' scores before and after, at their KL to the reference: the
figures step 3's PPO evaluations report, on the same prompts and sampling seeds;
dpo.export=best exports the best of them within the KL budget, as PPO does."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from engine.data_parallel import DataParallel
from engine.generation import SamplingSettings
from engine.models import disable_dropout, head_reduced, require_positions
from engine.packing import require_packing
from engine.runtime import Runtime
from engine.trainer import TrainEngine
from steps import supervised
from steps.algorithms import model_paths
from steps.common import (
    batches,
    in_chat_format,
    log,
    placement,
    require_trained_format,
    saving_chat_format,
    to_device,
    train_eval_examples,
)
from steps.config import DPOTrainConfig
from steps.data import PreferencePair
from steps.ppo import (
    DEFAULT_BEST_OF_N,
    DEMO_GOLD,
    EVAL_STREAM,
    answer_head,
    best_of_n_kl,
    model_tokenizer,
    row_seeds,
)
from steps.rlhf import (
    KTO,
    PER_TOKEN,
    REFERENCE_FREE,
    DPOLossOut,
    KTOLossOut,
    answer_mask,
    dpo_loss,
    kto_feedback_loss,
    kto_kl_point,
    kto_loss,
    logprobs_of_tokens,
    masked_sum,
    sequence_logprobs,
    token_kl,
)
from steps.scoring import RewardFunction, decode_rollouts
from steps.tokenize import (
    IGNORE_INDEX,
    DPOExample,
    FeedbackExample,
    collate_dpo,
    collate_feedback,
    collate_prompts,
    tokenize_dpo,
    tokenize_feedback,
)


def answer_logprobs(model, batch: dict[str, torch.Tensor], packed: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """([rows] fp32 sums of each row's answer-token log-probs, [rows] their counts) under
    `model` (a TrainEngine, a frozen causal LM, or a LoRA model's BaseWithoutAdapters) for
    collate_dpo's right-padded rows. The head runs a few rows at a time: the [rows, T, V]
    logits are never made whole (engine.models.head_reduced)."""
    labels = batch["labels"]
    # column t's target is token t + 1 (the last column's, a stand-in, is never read)
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).clamp(min=0)

    def taken(logits: torch.Tensor, rows: slice) -> torch.Tensor:
        return logprobs_of_tokens(logits, targets[rows])

    args = (batch["input_ids"], batch["attention_mask"], labels.shape[1], taken)
    reduced = (head_reduced(model, *args, packed=packed) if isinstance(model, torch.nn.Module)
               else model.head_reduced(*args, packed=packed))
    return sequence_logprobs(reduced, labels)


def pair_logps(sums: torch.Tensor, counts: torch.Tensor, per_token: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [B], rejected [B]) of collate_dpo's rows [2B]: the answers' log-probs, or with
    `per_token` (IPO) their means over each answer's tokens."""
    values = sums / counts.clamp(min=1) if per_token else sums
    chosen, rejected = values.chunk(2)
    return chosen, rejected


def pair_loss(sums: torch.Tensor, counts: torch.Tensor, ref_logps: torch.Tensor,
              dpo: DPOTrainConfig, num_pairs: int, kl_point: float = 0.0) -> DPOLossOut:
    """dpo.loss on collate_dpo's rows [2B]: the policy's answer log-prob sums and token
    counts, and the reference's sums (`ref_logps`), per token where the loss takes them
    (kto: at the reference point `kl_point`)."""
    per_token = dpo.loss in PER_TOKEN
    chosen, rejected = pair_logps(sums, counts, per_token)
    ref_chosen, ref_rejected = pair_logps(ref_logps, counts, per_token)
    if dpo.loss == KTO:
        return kto_loss(chosen, rejected, ref_chosen, ref_rejected, kl_point, dpo.beta,
                        dpo.desirable_weight, dpo.undesirable_weight, num_pairs=num_pairs)
    return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, dpo.beta, dpo.loss,
                    dpo.label_smoothing, num_pairs=num_pairs, gamma=dpo.simpo_gamma)


def mismatched_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """collate_dpo's KTO rows (kl_*) as answer_logprobs reads a batch."""
    return {"input_ids": batch["kl_input_ids"], "attention_mask": batch["kl_attention_mask"],
            "labels": batch["kl_labels"]}


def kl_point(model, batch: dict[str, torch.Tensor], dp: DataParallel, weight: float,
             packed: bool = False) -> float:
    """KTO's reference point z0 (steps.rlhf.kto_kl_point) over a batch's mismatched rows on
    every process: this process's share of them (collate_dpo's kl_* rows) counts `weight`
    times (0: a stand-in). Computed without gradient, as the paper does not train through
    it; one collective."""
    with torch.no_grad():
        sums, _ = answer_logprobs(model, mismatched_rows(batch), packed)
    total, count = dp.sum(weight * float((sums - batch["ref_kl_logps"]).sum()),
                          weight * len(sums))
    return kto_kl_point(total, count)


def feedback_loss(sums: torch.Tensor, batch: dict[str, torch.Tensor], dpo: DPOTrainConfig,
                  num_answers: int, kl_point: float) -> KTOLossOut:
    """KTO on collate_feedback's rows [B]: the policy's answer log-prob sums `sums`, their
    labels and the reference's sums from `batch`, at the reference point `kl_point`."""
    return kto_feedback_loss(sums, batch["ref_logps"], batch["desirable"], kl_point, dpo.beta,
                             dpo.desirable_weight, dpo.undesirable_weight, num_answers)


def labelled_rewards(rewards: torch.Tensor, desirable: torch.Tensor, examples: list
                     ) -> dict[str, torch.Tensor]:
    """This share's part of the mean implicit rewards of the desirable and the undesirable
    answers among `examples` (FeedbackExamples: the window's, or all held-out ones), and of
    their difference."""
    wanted = sum(ex.desirable for ex in examples)
    good = rewards[desirable].sum() / max(wanted, 1)
    bad = rewards[~desirable].sum() / max(len(examples) - wanted, 1)
    return {"desirable_reward": good, "undesirable_reward": bad, "margin": good - bad}


def batch_loss(model, batch: dict[str, torch.Tensor], examples: list[DPOExample] |
               list[FeedbackExample], dpo: DPOTrainConfig, dp: DataParallel
               ) -> tuple[torch.Tensor, dict]:
    """This process's share of the DPO loss (with dpo.nll_coef's term) and its statistics
    over `examples` (the batch, or its accumulation window): pairs, or KTO's unpaired
    feedback. KTO's reference point is the batch's, over all processes (`batch["weight"]`:
    this share's, 0 for a stand-in)."""
    n = len(examples)
    stats = {}
    z0 = 0.0
    if dpo.loss == KTO:
        z0 = kl_point(model, batch, dp, float(batch["weight"]), dpo.packing)
        # the window's mean of its batches' points, each by its examples
        stats["train/kl_point"] = torch.tensor(z0 * len(batch["ref_kl_logps"]) / n)
    sums, counts = answer_logprobs(model, batch, packed=dpo.packing)
    if "desirable" in batch:
        out = feedback_loss(sums, batch, dpo, n, z0)
        stats |= {"train/accuracy": out.accuracy,
                  **{f"train/{name}": value for name, value in
                     labelled_rewards(out.rewards, batch["desirable"], examples).items()}}
        taught = sums[batch["desirable"]]   # the desirable answers, for dpo.nll_coef
    else:
        out = pair_loss(sums, counts, batch["ref_logps"], dpo, n, kl_point=z0)
        stats |= {"train/accuracy": out.accuracy,
                  "train/chosen_reward": out.chosen_rewards.sum() / n,
                  "train/rejected_reward": out.rejected_rewards.sum() / n,
                  "train/margin": (out.chosen_rewards - out.rejected_rewards).sum() / n}
        taught = sums.chunk(2)[0]
    loss = out.loss
    if dpo.nll_coef:   # the chosen (desirable) answers' mean token cross entropy over the window
        nll = -taught.sum() / max(sum(ex.taught_tokens for ex in examples), 1)
        loss = loss + dpo.nll_coef * nll
        stats["train/nll"] = nll.detach()
    return loss, stats


def with_mismatched(examples: list[DPOExample] | list[FeedbackExample]
                    ) -> list[DPOExample] | list[FeedbackExample]:
    """`examples` for KTO: each one's prompt given the answer (a pair's chosen one) of the
    next example after it with another prompt (cyclically; the next one where all share
    it), a row whose log-ratio to the reference estimates the KL reference point z0 (the
    paper's mismatched pairs; TRL's KL dataset). Feedback often lists a prompt's answers
    together, which the next example alone would pair with their own prompt. Fixed once,
    as the reference's log-probs of these rows are computed once."""
    rows = [ex.first_row for ex in examples]
    prompts = [tuple(row[:ex.prompt_len]) for row, ex in zip(rows, examples, strict=True)]
    n = len(examples)
    # over the list twice around, the first place after each whose prompt differs: one pass
    # back, not a search per example (a prompt answered 10^4 times running would be 10^8)
    after: list[int | None] = [None] * (2 * n)
    for i in range(2 * n - 2, -1, -1):
        after[i] = i + 1 if prompts[(i + 1) % n] != prompts[i % n] else after[i + 1]
    mismatched = []
    for k, ex in enumerate(examples):
        other = after[k] % n if after[k] is not None and after[k] < k + n else (k + 1) % n
        answer = rows[other][examples[other].prompt_len:]
        mismatched.append(ex._replace(kl_ids=prompts[k] + tuple(answer)))
    return mismatched


@torch.no_grad()
def with_reference(model, examples: list[DPOExample], pad_token_id: int, batch_size: int,
                   dp: DataParallel, packed: bool = False) -> list[DPOExample]:
    """`examples` (pairs, or KTO's feedback) with their answers' log-probs under the frozen
    reference `model` filled in (KTO's mismatched rows' too), the same on every process
    (`packed`: dpo.packing's forwards)."""
    filled = []
    for batch in batches(examples, batch_size, shuffle=False, seed=0):
        share = dp.share(batch)
        rows = to_device(collate(share.rows, pad_token_id), dp.device)
        sums, _ = answer_logprobs(model, rows, packed)
        columns = [sums] if "desirable" in rows else list(sums.chunk(2))
        if "kl_input_ids" in rows:
            columns.append(answer_logprobs(model, mismatched_rows(rows), packed)[0])
        values = dp.batch_values(share, torch.stack(columns, 1), len(batch)).tolist()
        for ex, value in zip(batch, values, strict=True):
            kl = {"ref_kl": value.pop()} if ex.kl_ids else {}
            filled.append(ex._replace(**dict(zip(ex.REFERENCE_FIELDS, value, strict=True)),
                                      **kl))
    return filled


def collate(batch: list[DPOExample] | list[FeedbackExample], pad_token_id: int
            ) -> dict[str, torch.Tensor]:
    """collate_dpo's rows of pairs, collate_feedback's of feedback."""
    return (collate_dpo if isinstance(batch[0], DPOExample) else collate_feedback)(
        batch, pad_token_id)


@torch.no_grad()
def evaluate(engine: TrainEngine, reference, examples: list[DPOExample] |
             list[FeedbackExample], dpo: DPOTrainConfig, tokenizer, gold: RewardFunction | None,
             sampling: SamplingSettings, seed: int, dp: DataParallel) -> dict[str, float]:
    """On held-out pairs: the DPO loss, the share whose chosen answer's implicit reward is
    the higher (`accuracy`), the mean rewards and their margin (KTO: and its reference
    point z0, `kl_point`, each batch's over its mismatched rows); on held-out feedback
    (KTO), the share of answers on their label's side of z0 (`accuracy`), the mean
    rewards of the desirable and the undesirable answers and their margin. Then on answers
    to the first dpo.eval_prompts examples' prompts, sampled as step 3's evaluations sample them
    (`sampling`, rows seeded from `seed`), their KL to the `reference` and, with a `gold`
    function, their mean gold score and the greedy answers' (what chat.py answers)."""
    if not examples:
        return {}
    paired = isinstance(examples[0], DPOExample)
    totals = torch.zeros(4, dtype=torch.float64)
    points = 0.0   # KTO: each batch's z0 (the same on every process) by its examples
    for batch in batches(examples, dpo.eval_batch_size, shuffle=False, seed=0):
        share = dp.share(batch)
        rows = to_device(collate(share.rows, tokenizer.pad_token_id), dp.device)
        z0 = kl_point(engine, rows, dp, share.weight, dpo.packing) if dpo.loss == KTO else 0.0
        sums, counts = answer_logprobs(engine, rows, dpo.packing)
        points += z0 * len(batch)
        if paired:   # sums over the pairs
            out = pair_loss(sums, counts, rows["ref_logps"], dpo, num_pairs=1, kl_point=z0)
            rewards = (out.chosen_rewards.sum() / len(examples),
                       out.rejected_rewards.sum() / len(examples))
        else:        # sums over the answers; the rewards' means over each label's
            out = feedback_loss(sums, rows, dpo, num_answers=1, kl_point=z0)
            labelled = labelled_rewards(out.rewards, rows["desirable"], examples)
            rewards = labelled["desirable_reward"], labelled["undesirable_reward"]
        totals += share.weight * torch.tensor(
            [float(out.loss) / len(examples), float(out.accuracy) / len(examples),
             *map(float, rewards)], dtype=torch.float64)
    loss, accuracy, good, bad = dp.sum(*totals.tolist())
    names = ("chosen", "rejected") if paired else ("desirable", "undesirable")
    metrics = {"eval/loss": loss, "eval/accuracy": accuracy, f"eval/{names[0]}_reward": good,
               f"eval/{names[1]}_reward": bad, "eval/margin": good - bad,
               **({"eval/kl_point": points / len(examples)} if dpo.loss == KTO else {})}
    prompts = [ex.first_row[:ex.prompt_len] for ex in examples[:dpo.eval_prompts]]
    if prompts:
        metrics |= sampled_answers(engine, reference, prompts, tokenizer, gold, sampling, seed,
                                   dp, dpo.eval_batch_size)
    return metrics


def sampled_answers(engine, reference, prompts: list[list[int]], tokenizer,
                    gold: RewardFunction | None, sampling: SamplingSettings, seed: int,
                    dp: DataParallel, batch_size: int) -> dict[str, float]:
    """Over answers to `prompts` (token ids) generated from the engine's inference form: the
    mean KL(policy || reference) per sampled answer (over the vocabulary, as step 3's
    evaluations measure it: steps.rlhf.token_kl) and, with `gold`, the mean gold scores of
    the sampled and of the greedy answers. A prompt's sample is seeded by its place
    (steps.ppo.row_seeds' evaluation stream), so evaluations compare like with like."""
    totals = torch.zeros(3, dtype=torch.float64)
    greedy = SamplingSettings(sampling.max_new_tokens, do_sample=False)
    with engine.held_weights():   # one gather for all the batches
        for start, batch in zip(range(0, len(prompts), batch_size),
                                batches(prompts, batch_size, shuffle=False, seed=0),
                                strict=True):
            share = dp.share(batch)
            rows = to_device(collate_prompts(share.rows, tokenizer.pad_token_id), dp.device)
            seeds = row_seeds(seed, EVAL_STREAM, [start + i for i in share.index])
            for column, (settings, row_seed) in enumerate(((sampling, seeds), (greedy, None))):
                sequences = engine.generate(rows["input_ids"], rows["attention_mask"],
                                            settings, eos_token_id=tokenizer.eos_token_id,
                                            pad_token_id=tokenizer.pad_token_id,
                                            row_seeds=row_seed)
                prompt_len = rows["input_ids"].shape[1]
                if gold is not None:
                    texts = decode_rollouts(tokenizer, sequences, prompt_len)
                    totals[column] += share.weight * sum(gold(*texts))
                if column == 0:
                    totals[2] += share.weight * float(answers_kl(
                        engine, reference, sequences, rows["attention_mask"], tokenizer,
                        sampling.temperature).sum())
    sampled, greedy_total, kl = (total / len(prompts) for total in dp.sum(*totals.tolist()))
    return {"eval/kl": kl, **({"eval/ground_truth": sampled,
                               "eval/greedy_ground_truth": greedy_total} if gold else {})}


def answers_kl(engine, reference, sequences: torch.Tensor, prompt_mask: torch.Tensor,
               tokenizer, temperature: float) -> torch.Tensor:
    """[B] KL(policy || reference) of each generated answer in `sequences` [B, P + N] after
    its left-padded prompt (`prompt_mask` [B, P]): token_kl summed over the answer up to its
    EOS."""
    prompt_len = prompt_mask.shape[1]
    answered = answer_mask(sequences[:, prompt_len:], tokenizer.eos_token_id)
    args = (sequences, torch.cat([prompt_mask, answered.long()], 1), prompt_len)
    kl = token_kl(answer_head(engine, *args)[:, :-1], answer_head(reference, *args)[:, :-1],
                  temperature)
    return masked_sum(kl, answered, dim=1)


def standing(metrics: dict[str, float], budget: float) -> tuple[float, float] | None:
    """dpo.export=best's standing of an evaluation: (ground truth, accuracy), or (accuracy,
    -loss) without a ground truth; None past the KL `budget`."""
    if metrics.get("eval/kl", float("inf")) > budget:
        return None
    if "eval/ground_truth" in metrics:
        return metrics["eval/ground_truth"], metrics["eval/accuracy"]
    return metrics["eval/accuracy"], -metrics["eval/loss"]


def results(summary: dict, evaluated: bool) -> str:
    """The closing line's eval results: accuracy and margin, the greedy answers' gold
    score before -> after."""
    if not evaluated:
        return supervised.NOT_EVALUATED
    line = (f"eval accuracy {summary['eval/accuracy']:.3f} (implicit reward margin "
            f"{summary['eval/margin']:.3f})")
    for name, what in (("ground_truth", "ground truth"), ("greedy_ground_truth", "greedy"),
                       ("kl", "KL to the reference")):
        if f"eval/{name}" in summary:
            before = summary.get(f"eval/{name}_before")
            line += f", {what} " + (f"{before:.3f} -> " if before is not None else "") \
                + f"{summary[f'eval/{name}']:.3f}"
    if "eval/step_exported" in summary:   # dpo.export=best
        shown = [f"ground truth {summary['eval/ground_truth_exported']:.3f}"
                 ] if "eval/ground_truth_exported" in summary else []
        shown.append(f"KL {summary['eval/kl_exported']:.3f}")
        line += (f"; exported the policy of update {summary['eval/step_exported']} "
                 f"({', '.join(shown)})")
    return line


def dpo_examples(cfg: DictConfig, actor_path: str, pairs: list[PreferencePair],
                 held_out: list[PreferencePair] | None) -> tuple[object, list, list]:
    """(the actor's tokenizer in the run's chat format, training examples, held-out
    examples) of `pairs` and `held_out` (None: data.eval_fraction of `pairs`). With
    data.feedback_path, `pairs` are its feedback records (FeedbackExamples), and held-out
    pairs (data.eval_path) are read as two records each."""
    tokenizer = model_tokenizer(cfg, actor_path, "ppo.actor_path")
    require_trained_format(cfg, tokenizer, actor_path, "step 3")
    tokenizer = saving_chat_format(cfg, tokenizer)
    owner = f"the step-3 actor {actor_path}"
    feedback = bool(cfg.data.feedback_path)
    if feedback and held_out is not None:
        held_out = as_feedback(held_out)
    pairs = in_chat_format(cfg, "step 3", pairs, tokenizer, owner)
    if held_out is not None:
        held_out = in_chat_format(cfg, "step 3 held-out", held_out, tokenizer, owner)
    train, evals = train_eval_examples(
        cfg, 3, "feedback records" if feedback else "training pairs", pairs, tokenizer,
        tokenize_feedback if feedback else tokenize_dpo, held_out)
    if feedback:
        report_balance(train, cfg.dpo.desirable_weight, cfg.dpo.undesirable_weight)
        records = cfg.dpo.batch_size * cfg.dpo.grad_accum
        if records < MIN_FEEDBACK_BATCH:
            log(f"step 3 (KTO): {records} feedback records an update (dpo.batch_size x "
                f"dpo.grad_accum); with fewer than {MIN_FEEDBACK_BATCH} the demo's runs drifted "
                "from the reference (every answer less likely), where pairs hold as many "
                "desirable answers as undesirable: raise dpo.batch_size "
                "(bench/results/step3-kto-feedback-*)")
    return tokenizer, train, evals


# KTO on unpaired feedback: the fewest records an update that held the demo's runs near
# the reference (16 let the KL run to 19; bench/results/step3-kto-feedback-*)
MIN_FEEDBACK_BATCH = 32


def as_feedback(pairs: list[PreferencePair]) -> list[PreferencePair]:
    """Pairs as feedback records: the chosen answer desirable, the rejected one not."""
    return [record for pair in pairs for record in (
        pair._replace(label=True, rejected=""),
        pair._replace(chosen=pair.rejected, rejected="", label=False))]


def report_balance(examples: list[FeedbackExample], desirable_weight: float,
                   undesirable_weight: float) -> None:
    """Log the desirable and undesirable answers trained on, and, where their weighted
    ratio is outside the KTO paper's advice of [1, 4/3], the dpo.desirable_weight that
    brings it to 1: with far fewer of one kind, its losses are drowned by the other's."""
    wanted = sum(ex.desirable for ex in examples)
    unwanted = len(examples) - wanted
    log(f"step 3 (KTO): {wanted} desirable and {unwanted} undesirable answers to train on")
    if not wanted or not unwanted:
        which = "undesirable" if wanted else "desirable"
        log(f"step 3 (KTO): no {which} answers: KTO only pushes the others' likelihood; give "
            "feedback of both kinds")
        return
    ratio = desirable_weight * wanted / (undesirable_weight * unwanted)
    if not 1 <= ratio <= 4 / 3:
        log(f"step 3 (KTO): dpo.desirable_weight x desirable / (dpo.undesirable_weight x "
            f"undesirable) is {ratio:.2f}, outside the KTO paper's advice of 1 to 4/3; "
            f"dpo.desirable_weight={undesirable_weight * unwanted / wanted:.3g} makes it 1")


def load_policy(cfg: DictConfig, place, actor_path: str, tokenizer, dpo: DPOTrainConfig
                ) -> torch.nn.Module:
    """The step-1 actor to train, with dpo.lora's adapters, checked against the run's
    lengths and dpo.packing, its dropout off with ppo.disable_dropout."""
    model = place.causal_lm(actor_path, tokenizer, trained=True, seed=cfg.seed, lora=dpo.lora,
                            lora_key="dpo.lora", flag="ppo.actor_path", trained_head=True,
                            trust_remote_code=cfg.trust_remote_code)
    require_positions(model, cfg.data.max_prompt_len + cfg.data.max_answer_len,
                      f"data.max_prompt_len={cfg.data.max_prompt_len} + data.max_answer_len="
                      f"{cfg.data.max_answer_len}", f"ppo.actor_path {actor_path}")
    if dpo.packing:
        require_packing(model, "dpo.packing=true", f"ppo.actor_path {actor_path}")
    if cfg.ppo.disable_dropout:   # else the policy's log-probs at the start are not the reference's
        disable_dropout(model)
    return model


def run(cfg: DictConfig, pairs: list[PreferencePair], rt: Runtime, resume: bool = False,
        held_out: list[PreferencePair] | None = None) -> dict:
    """Train step 1's actor by DPO on `pairs`, evaluate on `held_out` (data.eval_path's
    pairs; None: data.eval_fraction of `pairs`), export it as <output_dir>/step3/actor."""
    actor_path, _ = model_paths(cfg)
    dpo: DPOTrainConfig = OmegaConf.to_object(cfg.dpo)
    dp, place = DataParallel(rt), placement(cfg, rt)
    tokenizer, train, evals = dpo_examples(cfg, actor_path, pairs, held_out)
    # the demo's gold score reads the demo's prompts: feedback of one's own is not them
    ppo, demo = cfg.ppo, list(cfg.data.path) == ["demo"] and not cfg.data.feedback_path
    spec = ppo.eval_reward_fn or (DEMO_GOLD if demo else None)
    gold = RewardFunction.named(spec, "ppo.eval_reward_fn") if spec else None
    # evaluations sample as step 3's do
    sampling = SamplingSettings(ppo.max_new_tokens, ppo.temperature, ppo.top_p, ppo.top_k)
    model = load_policy(cfg, place, actor_path, tokenizer, dpo)
    pad, reference = tokenizer.pad_token_id, None

    def prepare(engine: TrainEngine) -> list[DPOExample] | list[FeedbackExample]:
        """The reference's log-probs of every example (but for a reference-free loss): the
        policy as it starts, frozen (LoRA over a frozen base: the base, adapters off). It is
        kept only to measure the KL of sampled answers (dpo.eval_prompts)."""
        nonlocal evals, reference
        kl_measured = bool(dpo.eval_prompts and evals)
        if dpo.loss in REFERENCE_FREE and not kl_measured:
            return train
        reference = place.frozen_start(engine, actor_path, tokenizer, flag="ppo.actor_path",
                                       trained_head=True, trust_remote_code=cfg.trust_remote_code)
        if dpo.loss in REFERENCE_FREE:
            return train
        if dpo.loss == KTO:
            train_rows, evals = with_mismatched(train), with_mismatched(evals) if evals else evals
        else:
            train_rows = train
        filled = with_reference(reference, train_rows, pad, dpo.eval_batch_size, dp,
                                dpo.packing)
        evals = with_reference(reference, evals, pad, dpo.eval_batch_size, dp, dpo.packing)
        what = "feedback records" if cfg.data.feedback_path else "pairs"
        log(f"step 3 (DPO): the reference's log-probs of {len(filled)} training and "
            f"{len(evals)} held-out {what} computed")
        if not kl_measured:
            reference = None
        return filled

    task = supervised.Task(
        step=3, name="DPO", role="actor", family="policy", section=dpo, examples=train,
        collate=partial(collate, pad_token_id=pad), loss=partial(batch_loss, dpo=dpo, dp=dp),
        tokens=lambda batch: sum(ex.tokens for ex in batch),
        evaluate=lambda engine: evaluate(engine, reference, evals, dpo, tokenizer, gold,
                                         sampling, cfg.seed, dp),
        results=lambda summary: results(summary, bool(evals)),
        tokenizer=tokenizer, export_dir=Path(cfg.output_dir) / "step3" / "actor",
        prepare=prepare, generates=True, evaluate_first=True,
        standing=partial(standing, budget=ppo.kl_budget or best_of_n_kl(
            ppo.best_of_n or DEFAULT_BEST_OF_N)) if dpo.export == "best" else None,
        ema_beta=dpo.ema.beta if dpo.ema.enabled else None)
    summary = supervised.run(cfg, task, model, dp, place, resume)
    # an earlier run's critic and EMA (overwrite=true) must not pass for this run's
    for stale in ("critic", *(() if dpo.ema.enabled else ("actor_ema",))):
        dp.write_once(partial(shutil.rmtree, task.export_dir.parent / stale, ignore_errors=True))
    return summary
