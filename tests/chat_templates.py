"""Stock hub chat templates (no `{% generation %}` marks) and a hand-marked version of each, for the tests.

Each STOCK text reproduces the `chat_template` of a public Hugging Face hub file, written from that file (named
beside it); each MARKED text renders the same characters with the assistant's content and end-of-turn token
inside `{% generation %}` (the separator after the end-of-turn token and the assistant header outside), the
way LLaMA-Factory, axolotl and the transformers docs mark them. `Family` holds the special tokens each needs.
"""

from __future__ import annotations

from dataclasses import dataclass

# Qwen/Qwen2.5-7B-Instruct, tokenizer_config.json "chat_template" (the whole template, tool use included).
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# QWEN25 with the plain assistant turn in its own branch, marked (tool calls and tools left out: the tests hold
# plain conversations).
QWEN25_MARKED = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- generation %}
            {{- message.content + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- elif (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# meta-llama/Meta-Llama-3-8B-Instruct, tokenizer_config.json "chat_template".
LLAMA3 = (r"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
          r"+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 "
          r"== 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if "
          r"add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA3_MARKED = (r"{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}{{ "
                 r"'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}{% if message['role'] == "
                 r"'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
                 r"{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}{% if "
                 r"add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# mistralai/Mistral-7B-Instruct-v0.1, tokenizer_config.json "chat_template" (no generation prompt: the
# assistant's reply follows " [/INST]" directly).
_MISTRAL_ROLES = (r"{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 "
                  r"== 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') "
                  r"}}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
                  r"{% elif message['role'] == 'assistant' %}")
_MISTRAL_END = r"{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
MISTRAL = _MISTRAL_ROLES + r"{{ message['content'] + eos_token }}" + _MISTRAL_END
MISTRAL_MARKED = (_MISTRAL_ROLES + r"{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
                  + _MISTRAL_END)

# google/gemma-2-2b-it, tokenizer_config.json "chat_template" (gemma-7b-it's is the same).
_GEMMA_HEAD = (r"{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
               r"supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
               r"(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
               r"user/assistant/user/assistant/...') }}{% endif %}")
_GEMMA_TAIL = r"{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
GEMMA = (_GEMMA_HEAD + r"{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = "
         r"message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
         r"'<end_of_turn>\n' }}" + _GEMMA_TAIL)
GEMMA_MARKED = (_GEMMA_HEAD + r"{% if message['role'] == 'assistant' %}{{ '<start_of_turn>model\n' }}{% generation %}"
                r"{{ message['content'] | trim + '<end_of_turn>' }}{% endgeneration %}{{ '\n' }}{% else %}{{ "
                r"'<start_of_turn>' + message['role'] + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
                r"{% endif %}" + _GEMMA_TAIL)

# Not a reproduction: the rule of mistralai/Mistral-7B-Instruct-v0.3's template, reduced to it (the system
# message goes into the *last* user turn), so the start of a conversation renders differently once it goes on.
SYSTEM_IN_LAST_USER = (r"{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set "
                       r"rest = messages[1:] %}{% else %}{% set rest = messages %}{% endif %}{{ bos_token }}{% for m "
                       r"in rest %}{% if m['role'] == 'user' %}{% if loop.last and system is defined %}{{ '[INST] ' + "
                       r"system + '\n\n' + m['content'] + '[/INST]' }}{% else %}{{ '[INST] ' + m['content'] + "
                       r"'[/INST]' }}{% endif %}{% else %}{{ ' ' + m['content'] | trim + eos_token }}{% endif %}"
                       r"{% endfor %}")


@dataclass(frozen=True)
class Family:
    name: str
    stock: str
    marked: str
    bos: str | None
    eos: str
    eot: str      # the token that ends an assistant turn
    system: bool  # the template takes a system message


FAMILIES = [
    Family("qwen2.5", QWEN25, QWEN25_MARKED, None, "<|im_end|>", "<|im_end|>", True),
    Family("llama3", LLAMA3, LLAMA3_MARKED, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", True),
    Family("mistral", MISTRAL, MISTRAL_MARKED, "<s>", "</s>", "</s>", False),
    Family("gemma", GEMMA, GEMMA_MARKED, "<bos>", "<eos>", "<end_of_turn>", False),
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
