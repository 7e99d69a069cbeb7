"""The training loop: set up (or resume) the run, then per step rollout -> ``train_step`` (and
``critic_step``) -> metrics, sinks, progress, checkpoints; the final report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

import fnppo
from toy import rundir
from toy.cli import resume_command
from toy.collectives import agreed_lock, agreed_run_dir, agreed_sinks
from toy.distill import distill_loss, load_teacher, teacher_final_reward
from toy.errors import ArgumentError, Interrupted
from toy.model import build, critic_config, kl_controller, seed_everything, set_lr, step_config
from toy.partial import token_metrics
from toy.plot import write_plot
from toy.profiling import profiled
from toy.progress import make_progress, open_logging
from toy.rollout import rollout
from toy.settings import FINAL_WINDOW, check_resume_settings, learning_rate, policy_lr, run_settings
from toy.sync import make_engine, sync
from toy.task import VOCAB


def setup_run(args, layout):
    """Run directory, state, critic (``--algo ppo``, else None), reference params and the KL
    controller's state (restored on resume)."""
    out_dir = agreed_run_dir(args, layout)
    state = build(args)
    critic = build(args, head="value") if args.algo == "ppo" else None
    # the reference policy is the initial one: a copy of the weights, or with LoRA the base (adapters off)
    ref_params = fnppo.lora.adapters_off(state.model) if args.lora_rank else fnppo.models.snapshot_params(state.model)
    kl_state, _ = kl_controller(args)
    if args.resume:  # validate_args found a complete checkpoint written with this --algo
        try:  # a damaged newest checkpoint: refused on every rank (unless --resume-fallback), nothing loaded
            latest = fnppo.checkpoint.latest_checkpoint(out_dir / "checkpoints", fallback=args.resume_fallback)
        except fnppo.checkpoint.CheckpointError as err:
            raise ArgumentError(f"--resume: {err}; pass --resume-fallback to resume from the previous one") from None
        if latest is None:
            raise ArgumentError(f"--resume: {out_dir} has no complete checkpoint (write some with --save-every N)")
        try:  # a damaged file, another model: refused on every rank, nothing loaded (any layout loads)
            if critic is not None:
                states, extra = fnppo.checkpoint.load_checkpoint(latest, {"policy": state, "critic": critic})
                state, critic = states["policy"], states["critic"]
            else:
                state, extra = fnppo.checkpoint.load_checkpoint(latest, state)
        except fnppo.checkpoint.CheckpointError as err:
            raise ArgumentError(f"--resume: {err}") from None
        check_resume_settings(extra.get("settings", {}), args)
        # the reference policy is the initial one: rebuilt above from the settings, in this run's layout
        if "kl_state" in extra:
            kl_state = fnppo.kl.KLControllerState(**extra["kl_state"])
        if layout.rank == 0:
            print(f"resumed from {latest} (checkpoint of step {state.step // args.minibatches})")
    # one run per directory, held until the run ends: taken before anything is written there, after
    # everything that can refuse the run (a refused run leaves the directory as it was)
    lock = agreed_lock(out_dir, layout)
    return out_dir, lock, state, critic, ref_params, kl_state


def run(args: argparse.Namespace, layout) -> int:
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    seed_everything(args.seed)
    cfg = step_config(args)  # the configs first: nothing is created for a run that cannot start
    ccfg = critic_config(args) if args.algo == "ppo" else None
    agreed_sinks(args, layout)  # the --log sinks' packages import, before the lock and any file
    teacher = load_teacher(args) if args.distill_from else None  # its weights, before the student's
    out_dir, lock, state, critic, ref_params, kl_state = setup_run(args, layout)
    try:
        states = (state, critic, ref_params, kl_state)
        return train_loop(args, layout, device, (cfg, ccfg), out_dir, states, teacher=teacher)
    except KeyboardInterrupt:  # Ctrl-C: checkpoints are written atomically, so the newest complete one is whole
        raise Interrupted(how_to_resume(args, out_dir, layout.world_size)) from None
    finally:
        if lock is not None:
            lock.release()


def how_to_resume(args: argparse.Namespace, out_dir: Path, world_size: int = 1) -> str:
    """The line a Ctrl-C prints: the command that continues the run from the newest complete checkpoint
    (:func:`toy.cli.resume_command`: with the flags the run's settings do not store), or that there is none."""
    latest = rundir.newest_checkpoint(out_dir / "checkpoints")
    if latest is None:
        return f"no checkpoint in {out_dir} (--save-every N writes them); nothing to resume"
    step = json.loads((latest / "manifest.json").read_text())["step"]
    return f"resume with: {resume_command(args, out_dir, world_size)} (from {latest.name}, optimizer step {step})"


def train_loop(args: argparse.Namespace, layout, device, configs, out_dir: Path, states, teacher=None) -> int:
    """The steps from the (restored) states to ``--steps``: metrics, sinks, progress, checkpoints, the report;
    with a ``teacher`` (``--distill-from``, a ``fnppo.TeacherModel``) the loss has its distillation term."""
    cfg, ccfg = configs
    state, critic, ref_params, kl_state = states
    _, kl_update = kl_controller(args)
    rank0 = layout.rank == 0
    start_step = state.step // args.minibatches
    if rank0 and args.overwrite:
        rundir.replace_run(out_dir)
    metrics_path, rows = rundir.metrics_file(args, out_dir, start_step) if rank0 else (None, [])
    sinks = open_logging(args, out_dir, layout, resume_step=start_step if args.resume else None)
    progress = make_progress(args, start_step, "ppo") if rank0 else None
    start = time.perf_counter()
    step = start_step
    durations: list[float] = []  # wall time per step of this invocation
    # --staleness K: snapshots of the policy after each of the last K updates (the oldest samples)
    policies = [fnppo.models.snapshot_params(state.model)] if args.staleness else []
    # --sync: the sampler is an engine of its own, holding only the weights streamed to it
    engine = make_engine(state.model) if args.sync != "off" else None
    if engine is not None:
        engine, _ = sync(engine, state.model, args.sync, start_step, out_dir, layout)
    sync_total = {"sync/bytes": 0.0, "sync/seconds": 0.0}
    # --partial-rollouts: the tokens' ages for the version being trained (the step count), checked
    contract = fnppo.losses.Staleness(
        max_staleness=args.staleness, proximal="behaviour" if cfg.loss.bypass_old_logprobs else "old"
    )
    while step < args.steps:
        t_step = time.perf_counter()
        if args.exit_after is not None and step - start_step >= args.exit_after:
            if rank0:
                print(f"stopped after {args.exit_after} steps (--exit-after); resume with --resume")
            fnppo.sinks.close_sinks(sinks)
            return 0
        profiling = args.profile_step is not None and step + 1 == args.profile_step
        with profiled(profiling, args, out_dir, device, rank0) as phase:
            with phase("rollout"):
                behaviour = policies[0] if args.staleness else None  # K updates old (fewer in the first K steps)
                # the versions of the snapshots: the oldest is step + 1 - len(policies) (the current one is step)
                partial = (policies, step + 1 - len(policies)) if args.partial_rollouts else None
                samples, mean_reward, offpolicy = rollout(
                    state,
                    ref_params,
                    args,
                    layout,
                    device,
                    step,
                    critic,
                    phase=phase,
                    behaviour=behaviour,
                    sampler=None if engine is None else engine.model,
                    versions=partial,
                )
                if partial is not None:
                    samples, _ = contract.prepare(samples, current_version=step)
                    offpolicy.update(token_metrics(samples, layout, device))
            set_lr(state.optimizer, learning_rate(args, step, policy_lr(args)))
            step_cfg = dataclasses.replace(cfg, loss=fnppo.kl.with_kl_coef(cfg.loss, kl_state))
            if teacher is not None:
                step_cfg = dataclasses.replace(step_cfg, loss=distill_loss(step_cfg.loss, args, teacher))
            with phase("train_step"):
                state, metrics = fnppo.train_step(state, samples, step_cfg)
            critic_metrics = {}
            if critic is not None:
                set_lr(critic.optimizer, learning_rate(args, step, args.critic_lr))
                with phase("critic_step"):
                    critic, critic_metrics = fnppo.critic_step(critic, samples, ccfg)
        if args.staleness:  # the weights of the last K + 1 updates: the oldest samples the next step
            policies = [*policies, fnppo.models.snapshot_params(state.model)][-(args.staleness + 1) :]
        synced = {}
        if engine is not None:  # the updated weights to the sampler
            engine, synced = sync(engine, state.model, args.sync, step + 1, out_dir, layout)
            sync_total = {k: sync_total[k] + synced[k] for k in sync_total}
        step += 1
        durations.append(time.perf_counter() - t_step)
        row = {"step": step, "reward": mean_reward, **{k: v for k, v in metrics.items() if k != "step"}, **offpolicy}
        row.update(synced)
        row.update(
            {
                k if k.startswith(("vf_", "vpred")) else f"critic_{k}": v
                for k, v in critic_metrics.items()
                if k != "step"
            }
        )
        if args.kl_target is not None:
            row["kl_coef"] = kl_state.coef  # the coefficient this step trained with
        if args.batch_invariant:  # the sampler's log-probs against compute_logprobs' (0 bits differ in the mode)
            row["onpolicy/rollout_vs_old_max_abs_diff"] = max(
                float((s.rollout_logprobs - s.old_logprobs).abs().max()) for s in samples
            )
        kl_state = kl_update(kl_state, metrics.get("kl_loss", 0.0), n_steps=args.prompts * args.group_size)
        if args.layout_check and step == 1 and rank0:
            critic_part = (
                ""
                if critic is None
                else f" critic vf_loss={critic_metrics['vf_loss']:.10e} critic grad_norm={critic_metrics['grad_norm']:.10e}"
            )
            print(
                f"layout-check tp={layout.tp} pp={layout.pp} dp={layout.dp} ep={layout.ep}: first-step loss={metrics['loss']:.10e} grad_norm={metrics['grad_norm']:.10e}{critic_part}",
                flush=True,
            )
        if rank0:
            rundir.append_row(rows, metrics_path, row)
            fnppo.sinks.log_metrics(sinks, step, row)
            if progress is not None:
                extra_bar = (
                    {}
                    if critic is None
                    else {"vf": f"{critic_metrics['vf_loss']:.4f}", "ev": f"{critic_metrics['vf_explained_var']:.2f}"}
                )
                progress.set_postfix(
                    reward=f"{mean_reward:.3f}",
                    kl=f"{metrics.get('kl_loss', 0.0):.4f}",
                    ent=f"{metrics.get('entropy', 0.0):.3f}",
                    gnorm=f"{metrics['grad_norm']:.3f}",
                    **extra_bar,
                )
                progress.update(1)
        if args.save_every and step % args.save_every == 0:
            if rank0:  # the settings a later --resume reads before torch is imported (the checkpoint has them too)
                rundir.write_settings(out_dir, run_settings(args))
            extra = {"settings": run_settings(args), "kl_state": kl_state._asdict()}
            states = state if critic is None else {"policy": state, "critic": critic}  # one manifest: both or neither
            fnppo.checkpoint.save_checkpoint(out_dir / "checkpoints" / f"step{step:06d}", states, extra=extra)
    if progress is not None:
        progress.close()
    fnppo.sinks.close_sinks(sinks)
    if not rank0:
        return 0
    if engine is not None:
        n = max(1, step - start_step)
        print(
            f"sync {args.sync}: {sync_total['sync/bytes'] / n:,.0f} bytes and {sync_total['sync/seconds'] / n:.4f} s "
            f"per update (mean of {n})"
        )
    return report(args, layout, rows, out_dir, metrics_path, time.perf_counter() - start, step - start_step, durations)


def report(
    args,
    layout,
    rows: list[dict],
    out_dir: Path,
    metrics_path: Path,
    elapsed: float,
    steps_done: int,
    durations: list[float] | None = None,
) -> int:
    last = rows[-FINAL_WINDOW:]
    final = sum(r["reward"] for r in last) / max(1, len(last))
    ok = final >= args.target_reward
    print(
        f"steps: {args.steps}, wall time {elapsed:.1f} s ({elapsed / max(1, steps_done):.3f} s/step), layout tp={layout.tp} pp={layout.pp} dp={layout.dp}"
    )
    if durations and len(durations) > 3:  # the first steps compile kernels on CUDA
        later = sorted(durations[3:])
        print(f"median step after the first 3: {later[len(later) // 2]:.3f} s")
    print(f"metrics: {metrics_path}")
    if args.distill_from:
        teacher_reward = teacher_final_reward(args.distill_from)
        shown = "unknown" if teacher_reward is None else f"{teacher_reward:.3f}"
        print(
            f"distilled from {args.distill_from} (coef {args.distill_coef:g}{', alone' if args.distill_only else ''}); teacher's final reward {shown}"
        )
    verdict = "PASS" if ok else "FAIL"
    if not args.no_plot and rows:
        plot = out_dir / "ppo_toy.png"  # in the run directory, also when --metrics-out puts the metrics elsewhere
        out_dir.mkdir(parents=True, exist_ok=True)
        algo = (
            "GRPO"
            if args.algo == "grpo"
            else f"PPO (critic, GAE gamma {args.gamma:g} lambda {args.lam:g}, critic lr {args.critic_lr:g})"
        )
        title = (
            f"fnppo toy {algo} run: {verdict}, final reward {final:.3f} (target {args.target_reward:g})\n"
            f"seed {args.seed}, tp={layout.tp} pp={layout.pp} dp={layout.dp}, {args.dtype}, lr {args.lr:g} -> {args.lr * args.lr_final:g}, "
            f"{args.prompts} prompts x {args.group_size}, kl {args.kl_coef:g}"
            f"{'' if args.kl_target is None else f' (adaptive, target {args.kl_target:g})'}, entropy {args.entropy_coeff:g}"
        )
        try:
            write_plot(
                rows, plot, title=title, target=args.target_reward, chance=1.0 / VOCAB, critic=args.algo == "ppo"
            )
            print(f"plot: {plot}")
        except ImportError:
            print("plot: skipped (matplotlib is not installed; pip install 'fnppo[examples]')")
    if args.batch_invariant and rows:
        gaps = [(r["onpolicy/max_abs_ratio_minus_1"], r["onpolicy/rollout_vs_old_max_abs_diff"]) for r in rows]
        print(
            f"batch-invariant: max |ratio - 1| at the first pass over {len(rows)} steps: {max(g[0] for g in gaps):.3g}; "
            f"max |rollout - compute_logprobs| log-prob: {max(g[1] for g in gaps):.3g}"
        )
    print(
        f"final reward (mean of last {len(last)} steps): {final:.3f} -> {verdict}: {'reached' if ok else 'did NOT reach'} the target {args.target_reward:g}"
    )
    return 0 if ok else 1
