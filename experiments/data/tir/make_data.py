r"""Writes the example TIR dataset and its tokenizer here; re-running reproduces the same files.

    .venv/bin/python experiments/data/tir/make_data.py

train.jsonl, heldout.jsonl: rows {"prompt": question, "answer": exact answer} from
`python_tool.problem_stream` (seeds 0 and 1; no held-out question is also a training question).
tokenizer/: a byte-level BPE of at most 512 ids (special tokens `<|endoftext|>` = pad,
`<|im_start|>`, `<|im_end|>` = eos) trained on the chat-rendered prompts of the training problems
with worked solutions: a Python snippet, the environment's `<output>` block, `\boxed{}`. The
pre-tokenizer is Qwen2's (digits one by one, so a number's tokens are its digits), so a closing
fence "```\n" is a token of its own, distinct from the "```" that opens "```python": the worker
stops actions at it (`python_tool.stop_token_ids`). The chat template is Qwen-style ChatML
without a default system message.
"""

from __future__ import annotations

import json
import os
import re

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from sao_jax.envs.python_tool import PythonToolEnv, problem_stream
from sao_jax.envs.sandbox import SandboxResult
from sao_jax.text import render_chat_template

HERE = os.path.dirname(os.path.abspath(__file__))
NUM_TRAIN, NUM_HELDOUT, TRAIN_SEED, HELDOUT_SEED = 200, 50, 0, 1
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer pattern.
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "{{- raise_exception('Only system, user and assistant roles are supported, got ' "
    "+ message['role']) }}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def problems(seed: int, count: int, exclude=frozenset()) -> list:
    unique = {}
    for problem in problem_stream(seed):
        if problem.question not in exclude:
            unique.setdefault(problem.question, problem)
        if len(unique) == count:
            return list(unique.values())


def solution_code(question: str) -> str:
    """A short Python program that prints the answer to one of `random_problem`'s questions."""
    if m := re.match(r"What is the remainder when (\d+)\^(\d+) is divided by (\d+)\?", question):
        return "print(pow({}, {}, {}))".format(*m.groups())
    if m := re.match(r"What is the sum of all positive integers less than (\d+) that are "
                     r"divisible by (\d+) or by (\d+)\?", question):
        n, p, q = m.groups()
        return f"print(sum(k for k in range(1, {n}) if k % {p} == 0 or k % {q} == 0))"
    if m := re.match(r"Compute (.*)\. Give the answer", question):
        denominators = ", ".join(re.findall(r"1/(\d+)", m.group(1)))
        return ("from fractions import Fraction\n"
                f"print(sum(Fraction(1, d) for d in [{denominators}]))")
    if m := re.match(r"How many positive divisors does (\d+) have\?", question):
        return (f"n = {m.group(1)}\ncount = 0\nd = 1\nwhile d * d <= n:\n"
                "    if n % d == 0:\n        count += 1 if d * d == n else 2\n    d += 1\n"
                "print(count)")
    if m := re.match(r"What is the sum of the digits of (\d+)\^(\d+)\?", question):
        return "print(sum(int(c) for c in str({} ** {})))".format(*m.groups())
    raise ValueError(f"no solution for {question!r}")


def transcripts(train) -> list[str]:
    """Chat-rendered episodes: prompt, a code block, the environment's output, the answer."""
    env = PythonToolEnv("", "0")
    failed = SandboxResult(stdout="", stderr="Traceback (most recent call last):\n  File "
                           "\"<stdin>\", line 1, in <module>\nNameError: name 'n' is not defined\n",
                           exit_code=1, killed_by=None, timed_out=False, stdout_truncated=False,
                           stderr_truncated=False, wall_seconds=0.1, cpu_seconds=0.1, uid=0)
    texts = []
    for i, problem in enumerate(train):
        prompt = PythonToolEnv(problem.question, problem.answer).reset()
        printed = SandboxResult(**{**vars(failed), "stdout": problem.answer + "\n", "stderr": "",
                                   "exit_code": 0})
        answer = (f"I will compute this with Python.\n```python\n{solution_code(problem.question)}"
                  f"\n```\n{env.format_output(failed if i % 10 == 0 else printed)}")
        answer += f"The answer is \\boxed{{{problem.answer}}}."
        texts.append(render_chat_template(CHAT_TEMPLATE, [{"role": "user", "content": prompt},
                                                          {"role": "assistant",
                                                           "content": answer}],
                                          add_generation_prompt=False))
    return texts


def train_tokenizer(texts) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def write_jsonl(path: str, rows) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for problem in rows:
            f.write(json.dumps({"prompt": problem.question, "answer": problem.answer}) + "\n")


def main(out_dir: str = HERE) -> None:
    """Writes train.jsonl, heldout.jsonl and tokenizer/ into `out_dir`."""
    train = problems(TRAIN_SEED, NUM_TRAIN)
    heldout = problems(HELDOUT_SEED, NUM_HELDOUT, exclude={p.question for p in train})
    write_jsonl(os.path.join(out_dir, "train.jsonl"), train)
    write_jsonl(os.path.join(out_dir, "heldout.jsonl"), heldout)

    tokenizer = train_tokenizer(transcripts(train))
    if tokenizer.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"{tokenizer.get_vocab_size()} ids, more than {VOCAB_SIZE}")
    out = os.path.join(out_dir, "tokenizer")
    os.makedirs(out, exist_ok=True)
    tokenizer.save(os.path.join(out, "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    print(f"{len(train)} train and {len(heldout)} held-out problems, "
          f"{tokenizer.get_vocab_size()} token ids: {out_dir}")


if __name__ == "__main__":
    main()
