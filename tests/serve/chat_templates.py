# ruff: noqa: E501 - the templates keep their lines as the checkpoints ship them
"""Chat templates in the form each supported family's instruct checkpoints ship them (from
their tokenizer configs: Mixtral-8x7B-Instruct, Qwen1.5-MoE-A2.7B-Chat, Qwen3-MoE,
OLMoE-Instruct), kept here because tests download nothing. Multi-line ones keep the
indentation and block tags that make ``trim_blocks`` / ``lstrip_blocks`` matter."""

MIXTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}")

QWEN2_MOE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

QWEN3_MOE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

OLMOE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
{{ '<|system|>\\n' + message['content'] + '\\n' }}
    {% elif message['role'] == 'user' %}
{{ '<|user|>\\n' + message['content'] + '\\n' }}
    {% elif message['role'] == 'assistant' %}
        {% if not loop.last %}
{{ '<|assistant|>\\n'  + message['content'] + eos_token + '\\n' }}
        {% else %}
{{ '<|assistant|>\\n'  + message['content'] + eos_token }}
        {% endif %}
    {% endif %}
    {% if loop.last and add_generation_prompt %}
{{ '<|assistant|>\\n' }}
    {% endif %}
{% endfor %}
"""

# the helpers transformers gives every template: tojson (no HTML escaping), loop controls,
# a namespace, strftime_now
HELPERS = """{%- set ns = namespace(n=0) %}
{%- for m in messages %}
    {%- if m.role == 'tool' %}{% continue %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
{{ m | tojson }}
    {%- if ns.n >= 3 %}{% break %}{% endif %}
{%- endfor %}
{{ pad_token }}|{{ unk_token }}|{{ strftime_now('%Y') | length }}
"""

FAMILIES = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE,
            "olmoe": OLMOE, "helpers": HELPERS}
