"""`--chat_template`: a Jinja file, or a built-in by name, for tokenizers that ship without one (base models, the
GPT-2 vocabulary of our benchmarks), as TRL's `chat_template_path` and axolotl's `chat_template:` do. It is set on
the tokenizer, so the exported tokenizer carries it and the fine-tuned model chats the way it was trained.

The built-ins write each format's markers as text: a vocabulary that lacks them as tokens (GPT-2's) spells them in
several tokens, which trains and generates the same way, only longer; no embedding row is added.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

# written for aqpipe from each format's published layout (role headers, an end-of-turn marker, the generation prompt)
BUILTIN = {
    "chatml": ("{% for message in messages %}"
               "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
               "{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "llama3": ("{{ bos_token }}"
               "{% for message in messages %}"
               "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] "
               "+ '<|eot_id|>' }}"
               "{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
}


def read_chat_template(value: str) -> str:
    """The template `value` names: a built-in's, or a file's text (ValueError naming what was expected)."""
    if value in BUILTIN:
        return BUILTIN[value]
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--chat_template {value}: no such file; expected a Jinja template file or one of "
                         f"{', '.join(BUILTIN)}")
    text = path.read_text(encoding="utf-8")
    if "messages" not in text:
        raise ValueError(f"--chat_template {value}: it never reads `messages`; expected a Jinja chat template "
                         "(a loop over messages, each with role and content)")
    return text


def apply_chat_template_setting(tokenizer: Any, value: str | None) -> Any:
    """`tokenizer` with the template `value` names (None: its own, if any)."""
    if value is not None:
        tokenizer.chat_template = read_chat_template(value)
    return tokenizer
