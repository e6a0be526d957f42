"""Defaults shared by every experiment; the others derive from `get_config()` here.

Not an experiment by itself: it has no task. Launch one of the files next to it, e.g.

    make train EXP=toy ARGS='--config.algo=grpo_dis --config.total_steps=200'
    python -m sao_jax.main --config=experiments/toy.py --workdir=runs/toy

Fields (every one can be overridden with `--config.<path>=<value>`; unknown paths fail):
  algo                   sao | grpo | grpo_dis | grpo_tis | grpo_icepop | grpo_geomask | vapo |
                         running_mean | sao_k1 | sao_full_critic | sao_step_value
                         (docs/algorithm.md §5)
  mode                   async (train on rollouts as they arrive) | sync (generate a batch, then
                         train on it)
  total_steps            learner steps, critic warm-up steps included, counted from 1
  batch_size             trajectories per step (whole groups for the GRPO variants)
  max_staleness          a trajectory whose oldest token is more than this many policy versions
                         behind is dropped and its prompt issued again; also caps admission
                         (rollout.max_in_flight) at max(1, max_staleness) * batch_size
  publish_every          push weights to the engines every N policy updates
  checkpoint_every       steps between orbax checkpoints (and one at the end)
  eval_every             steps between held-out evaluations (0: at the start and the end only)
  precompile_steps       compile the learner step for every batch shape the run can meet
                         (packed row counts, or padded lengths up to
                         rollout.engine_max_seq_len) on a thread, while the engines start
                         and the first steps run (a step waits only for its own); and the
                         embedded engines every prefill bucket before they answer
  pack_rows              pack several trajectories into each model row of the learner's step
                         (rows of rollout.engine_max_seq_len + 1, bucketed), instead of one
                         padded row each; only where the step allows (DIS policy loss, one
                         microbatch), else rows stay padded and the log says so
  compilation_cache      keep compiled programs in the JAX cache under the warm-start cache dir
  model.*                preset name (model.num_layers: its depth) or Hugging Face
                         directory, dtype, MoE dispatch
  warm_start.*           supervised warm start on the environment's teacher (calculator,
                         style_shift, swe), cached; its own seed (warm_start.seed), shared by
                         the RL seeds of an ablation
  rl.*                   the hyperparameters of docs/algorithm.md §1-§4; None: the algorithm's own
  optim.{policy,critic}  AdamW settings (mu_dtype: the first moment's dtype, "" the
                         parameters')
  mesh                   learner mesh axis sizes (data, fsdp, expert, tensor); data = 0 (the
                         default) takes the devices the other axes leave: all of them by default;
                         mesh.rules.<logical axis> the mesh axes that split it, a tuple
                         (--config.mesh.rules.embed='("fsdp", "tensor")'; () replicates),
                         defaults from sao_jax.axes.DEFAULT_RULES
  plan.topology          the TPU topology `make plan` compiles the learner step for (e.g.
                         v5p:2x4x4, 32 chips); its mesh is `mesh`
  env.*                  the task; env.swe.* the SWE workspaces and grading
  rollout.*              engines and workers; rollout.max_restarts, lease_timeout_s,
                         weight_update_timeout_s and request_timeout_s: what happens when one
                         of them fails (docs/faults.md, "Faults and the soak test")
"""

import ml_collections

from sao_jax import axes


def get_config():
    config = ml_collections.ConfigDict()
    config.name = "base"
    config.algo = "sao"
    config.mode = "async"
    config.seed = 0
    config.total_steps = 1000
    config.batch_size = 128
    config.max_staleness = 4
    config.publish_every = 1
    config.checkpoint_every = 50
    config.keep_checkpoints = 3
    config.eval_every = 0
    config.sample_every = 50
    config.compilation_cache = True
    config.precompile_steps = True
    config.pack_rows = True

    config.model = ml_collections.ConfigDict()
    config.model.preset = ""  # a sao_jax.models.config preset, or
    config.model.num_layers = 0  # with a preset: its depth (0 = the preset's own)
    config.model.path = ""  # a local Hugging Face directory (config.json + safetensors)
    # The dtype the learner's passes compute in and the engines serve (both sides of the
    # training-inference gap), and the one the learner keeps the policy, the critic and their
    # optimizers' moments in: AdamW's update is added there. A bfloat16 master copy rounds away
    # updates below half a weight's spacing (docs/algorithm.md, "The training-inference gap").
    config.model.dtype = "float32"
    config.model.master_dtype = "float32"
    config.model.moe_dispatch = "dense"
    config.model.logprob_dispatch = "dense"
    # The learner runs the layers under lax.scan (the step holds one layer whatever the depth);
    # remat: "none", "full", "save_dots" or "nested" (recompute in the backward pass;
    # ModelConfig.remat).
    config.model.scan_layers = True
    config.model.remat = "none"
    # The learner's attention: "dense" ([B, heads, T, T] scores) or "blockwise" (no [T, T]
    # array: long rows; ModelConfig.attention), in blocks of attention_block tokens.
    config.model.attention = "dense"
    config.model.attention_block = 512
    # Tokens per device sent through a MoE layer's experts at once in training passes (0: all).
    config.model.moe_token_chunk = 8192

    config.warm_start = ml_collections.ConfigDict()
    config.warm_start.enabled = False
    # The warm start's own seed: runs that differ only in `seed` (the RL seed: the prompt order,
    # the critic's and the sampler's randomness) start from the same warm-started policy, as the
    # paper's runs all start from one SFT checkpoint (docs/algorithm.md §6).
    config.warm_start.seed = 0
    config.warm_start.max_steps = 4000
    config.warm_start.batch = 64
    config.warm_start.learning_rate = 3e-3
    # The calculator teacher's share of answers guessed at once, without the tool (its registry
    # entry reads it, `calculator.warm_start_teacher`); other teachers ignore it.
    config.warm_start.guess_rate = 0.0
    config.warm_start.eval_every = 100
    config.warm_start.patience = 4
    config.warm_start.min_delta = 2e-3
    # Held-out transcripts (at most) each evaluation's loss is measured on, and how many of a
    # stream's transcripts size the rows (the longest, rounded up to 64) and check the actions.
    config.warm_start.held_out = 512
    config.warm_start.sample = 256
    config.warm_start.cache_dir = ""  # "" = $XDG_CACHE_HOME/sao_jax

    config.rl = ml_collections.ConfigDict()
    config.rl.gamma = 1.0
    config.rl.critic_lambda = 1.0  # the critic's targets: Monte-Carlo returns (decoupled GAE)
    config.rl.eps_low = 0.3  # DIS band 0.7 .. 6.0 (reasoning / TIR)
    config.rl.eps_high = 5.0
    config.rl.dis_denominator = "action_tokens"
    config.rl.critic_warmup_steps = 10
    # Extend the critic-only warm-up until explained variance stalls (None: the algorithm's own
    # choice, True for vapo).
    config.rl.value_pretraining = ml_collections.FieldReference(None, field_type=bool)
    config.rl.value_pretraining_max_steps = 200
    # "Stalls": this many batches in a row without lifting the running mean of the last `window`
    # batches' explained variance above its best by more than min_delta (train.plateau.Plateau).
    config.rl.value_pretraining_patience = 5
    config.rl.value_pretraining_min_delta = 0.01
    config.rl.value_pretraining_window = 5
    config.rl.critic_steps = ml_collections.FieldReference(None, field_type=int)
    config.rl.group_size = ml_collections.FieldReference(None, field_type=int)
    config.rl.lam_alpha = ml_collections.FieldReference(None, field_type=float)
    # A typical response's action tokens on this task: an algorithm whose alpha was set for
    # other lengths (vapo: ~2000 tokens) has it scaled to these (None: used as stated).
    config.rl.response_tokens = ml_collections.FieldReference(None, field_type=int)
    # vapo's positive-example LM loss weight, and the critic's learning rate as a multiple of the
    # policy's (None: the algorithm's own; a ratio replaces optim.critic.learning_rate).
    config.rl.lm_coef = ml_collections.FieldReference(None, field_type=float)
    config.rl.critic_lr_ratio = ml_collections.FieldReference(None, field_type=float)
    config.rl.ppo_minibatches = 4
    config.rl.ppo_clip_low = 0.2
    config.rl.ppo_clip_high = 0.28
    config.rl.whiten_advantages = False
    # Routing replay (a model with experts): the engines report the experts they routed every
    # token to (--enable-return-routed-experts), the workers ask for them each turn, and the
    # policy's passes in the learner use them instead of its own router's top-k (docs/models.md)
    config.rl.routing_replay = False
    # The engines' routes without the replay: the learner routes itself and logs how often it
    # chose the engine's experts (policy/routed_same) and the gap on either side
    config.rl.engine_routes = False
    config.rl.reuse_values = False
    config.rl.value_clip = ml_collections.FieldReference(None, field_type=float)
    config.rl.microbatches = 1
    config.rl.gae_impl = "auto"  # rl.gae: auto | xla | reference | pallas | cpu
    # Returns of episodes cut by a limit end in the critic's value (True) or in their rewards,
    # as finished ones (False: where the limit ends the task, e.g. SWE: no submission, no fix;
    # the toy: no answer).
    config.rl.bootstrap_truncated = True
    config.rl.dis_impl = "auto"  # rl.dis_loss: auto | xla | pallas ("auto": Pallas on TPU)
    config.rl.baseline_window = 8  # running_mean: rewards per prompt
    config.rl.global_baseline = False  # running_mean: one window over all prompts, of
    config.rl.global_baseline_window = 128  # this many rewards

    config.optim = ml_collections.ConfigDict()
    config.optim.policy = ml_collections.ConfigDict(dict(
        learning_rate=1e-6, weight_decay=0.0, grad_clip_norm=1.0, warmup_steps=0, b2=0.999,
        eps=1e-8, mu_dtype=""))
    config.optim.critic = ml_collections.ConfigDict(dict(
        learning_rate=5e-6, weight_decay=0.0, grad_clip_norm=1.0, warmup_steps=0, b2=0.999,
        eps=1e-8, mu_dtype=""))

    # The learner's mesh axis sizes; data = 0 takes whatever devices the others leave.
    config.mesh = ml_collections.ConfigDict(dict(data=0, fsdp=1, expert=1, tensor=1))
    # Logical-to-mesh axis rules: for each logical axis of axes.DEFAULT_RULES (its defaults),
    # the mesh axes that split it, e.g. config.mesh.rules.embed = ("fsdp", "tensor"); () replicates.
    config.mesh.rules = ml_collections.ConfigDict(dict(axes.DEFAULT_RULES))
    # `make plan`: the TPU slice the learner step is compiled for (sao_jax.train.plan).
    config.plan = ml_collections.ConfigDict()
    config.plan.topology = "v5p:2x2x1"

    config.env = ml_collections.ConfigDict()
    config.env.name = ""
    config.env.max_turns = 8
    config.env.max_action_tokens = 64
    config.env.max_response_tokens = 512
    config.env.num_train_prompts = 0  # generated tasks: how many distinct training prompts
    config.env.num_eval_prompts = 200
    # The calculator's problems: binary operations per expression (each a dependent tool call
    # in the teacher's solution) and the largest operand.
    config.env.num_ops = 2
    config.env.max_operand = 30
    # style_shift: the learner step from which each style is rewarded ("" = terse, wordy from
    # step 150, terse from 300; sao_jax.envs.style_shift.parse_schedule).
    config.env.style_schedule = ""
    config.env.train_path = ""  # JSONL datasets (tir)
    config.env.eval_path = ""
    config.env.tokenizer = ""  # a Hugging Face tokenizer directory ("" = the toy tokenizer)
    # SWE agents (env.name = "swe"): train_path / eval_path are SWE-bench JSONL task files
    # (eval_path "": the last num_eval_prompts tasks of train_path are held out).
    config.env.swe = ml_collections.ConfigDict()
    config.env.swe.backend = "namespace"  # namespace | podman | docker (sao_jax.envs.swe)
    # podman/docker: the image of a task without an `image` field ({instance_id}, {repo},
    # {version}, {id_docker}); SWE-bench's published evaluation images by default.
    config.env.swe.image_template = "docker.io/swebench/sweb.eval.x86_64.{id_docker}:latest"
    config.env.swe.command_timeout = 60.0  # seconds per bash command
    config.env.swe.output_chars = 10000  # observation budget (head and tail kept)
    # The first user message ({problem_statement}, {root}, {instance_id}, {max_turns}); "" =
    # sao_jax.envs.swe.env.PROMPT, which explains the bash protocol.
    config.env.swe.prompt_template = ""
    config.env.swe.grade_timeout = 1800.0  # seconds for a task's test run
    config.env.swe.grade_concurrency = 2  # gradings at once per worker
    # The warm start's expert (sao_jax.envs.swe.teacher): "patch" (find, read, git apply the
    # gold patch, test, submit) or "edit" (cat -n, then one sed line edit and the submission:
    # one-line-fix tasks such as swe_tiny's), and the share of tasks where "edit" writes a wrong
    # fix instead (a mutation.decoys line). expert_tasks: what it plays, "rows" (the run's
    # training rows, in real workspaces) or "swe_tiny" (endless fresh tasks of that family,
    # sao_jax.envs.swe.tiny, never in a held-out file: "edit" only). expert_read: how "edit"
    # reads the file, "cat" (`cat -n FILE`) or "grep" (`grep -Hn '' FILE`: the path on every line);
    # expert_fix: how it edits, "sub" (`sed -i 'Ns/OLD/NEW/'`) or "line" (`sed -i 'Nc\LINE'`);
    # expert_decoy: which wrong fix it makes, "random" (any decoy) or "first" (always the first);
    # expert_mistake_kinds: the mutation kinds it errs on, comma-separated ("" = every kind).
    config.env.swe.expert = "patch"
    config.env.swe.expert_mistakes = 0.0
    config.env.swe.expert_tasks = "rows"
    config.env.swe.expert_read = "cat"
    config.env.swe.expert_fix = "sub"
    config.env.swe.expert_decoy = "random"
    config.env.swe.expert_mistake_kinds = ""

    config.rollout = ml_collections.ConfigDict()
    # embedded (the JAX engine) | sglang: real SGLang servers, those of engine_urls
    # (comma-separated base URLs, started by you) or, without URLs, num_engines servers started
    # on this host from SGLang's own virtualenv, made on first use (sao_jax.engine.sglang_server)
    config.rollout.engine = "embedded"
    config.rollout.engine_urls = ""
    config.rollout.sglang = ml_collections.ConfigDict()
    # cpu: SGLang's plain-torch paths and the CPU stand-in for sgl_kernel | cuda: a GPU host
    config.rollout.sglang.device = "cpu"
    config.rollout.sglang.venv = ""  # "" = $SAO_SGLANG_VENV or the shared cache
    config.rollout.sglang.extra_args = ""  # more sglang.launch_server flags
    config.rollout.sglang.startup_timeout_s = 600.0  # one server's start (~1-2 min on a CPU)
    config.rollout.num_engines = 1
    config.rollout.engine_max_batch = 64
    config.rollout.engine_max_seq_len = 1024
    config.rollout.num_workers = 1
    config.rollout.worker_concurrency = 64
    # Async admission: prompts leased or answered but not yet trained on. 0: every rollout slot
    # (num_workers * worker_concurrency) plus one batch, capped at max_staleness batches
    # (build.admission_limit); a backlog beyond that only makes trajectories stale.
    config.rollout.max_in_flight = 0
    # Injected staleness: the engines serve the weights this many publishes behind the newest
    # (rollouts at least lag_versions * publish_every policy versions old; evaluations see the
    # newest). Needs max_staleness >= that. 0: off.
    config.rollout.lag_versions = 0
    config.rollout.temperature = 1.0
    config.rollout.queue_size = 512
    # CPU scheduling class of the embedded engines and the workers: normal | low (nice 10) |
    # idle (SCHED_IDLE). On a shared host the learner's step is the bottleneck, so rollouts take
    # the CPU it leaves (processes.Children).
    config.rollout.priority = "low"
    # Faults (supervisor.Supervisor): an engine or worker that dies is restarted, at most this many
    # times per child and run; one more death stops the run, naming the child's log.
    config.rollout.max_restarts = 3
    # A leased prompt not answered within this time is issued again (its worker died). Keep it
    # above the longest episode, or slow episodes are played twice (both answers are kept).
    config.rollout.lease_timeout_s = 600.0
    # A weight update an engine does not finish within this time (frozen, or gone) leaves that
    # engine behind; it gets the newest weights when it answers again (publish.Publisher).
    config.rollout.weight_update_timeout_s = 600.0
    # Embedded engines: a weight update lets running requests finish for up to this many
    # seconds (the waiting and new ones are held for the new weights), then cuts those still
    # running, which are resubmitted and prefilled again under the new weights. 0: cut at once.
    # Short turns (a few tokens) finish within the drain instead of paying a prefill of their
    # whole history again; SGLang servers have no such option (must stay 0 there).
    config.rollout.update_drain_s = 0.0
    # A worker's /generate call with no answer this long (a frozen engine) fails over to another
    # engine (the workers' --request-timeout-s); 0: the workers' default.
    config.rollout.request_timeout_s = 0.0
    return config
