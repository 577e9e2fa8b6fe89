"""A multi-turn tool-use rollout for `miles train` (slime's custom generate function contract).

The model may call a calculator by writing <calc>EXPRESSION</calc>; the function evaluates the
expression (integers, + - * / % and parentheses), appends <result>VALUE</result> to the
sample and lets the model go on, at most MAX_CALLS times. The tool's tokens are masked out of
the loss (loss_mask 0); every other token is the engine's, with the engine's logprob, which
miles checks before it trains on the sample.

    miles train --config examples/calculator-tool/addition.toml

It talks to the rollout engine's HTTP server as it would to SGLang: /generate, /tokenize and
/detokenize at args.sglang_router_ip:args.sglang_router_port.
"""

import ast
import operator

from slime.utils.http_utils import post
from slime.utils.types import Sample

MAX_CALLS = 3
OPEN, CLOSE = "<calc>", "</calc>"
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calculate(expression):
    """The value of an arithmetic expression, or why there is none (never raises)."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if abs(left) > 10**12 or abs(right) > 10**12:
                raise ValueError("too large")
            return OPERATORS[type(node.op)](left, right)
        raise ValueError("not arithmetic")

    if len(expression) > 200:
        return "error: too long"
    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)


async def generate(args, sample, sampling_params):
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
    tokens = list(sample.tokens)
    prompt_length = len(tokens)
    loss_mask, logprobs, calls = [], [], []
    # The same parameters every turn, so that turns of different samples batch together; the
    # response's length is bounded here instead.
    params = dict(sampling_params, stop=list(sampling_params.get("stop") or []) + [CLOSE])
    budget = sampling_params["max_new_tokens"]
    status = Sample.Status.COMPLETED
    while True:
        out = await post(url + "/generate", {"input_ids": tokens, "sampling_params": params,
                                             "return_logprob": True})
        for logprob, token, _ in out["meta_info"]["output_token_logprobs"]:
            tokens.append(token)
            loss_mask.append(1)
            logprobs.append(logprob)
        text = out["text"].rstrip()
        if len(loss_mask) >= budget:
            status = Sample.Status.TRUNCATED
            break
        if out["meta_info"]["finish_reason"]["type"] == "length":
            status = Sample.Status.TRUNCATED
            break
        if not text.endswith(CLOSE) or OPEN not in text or len(calls) == MAX_CALLS:
            break
        expression = text[text.rindex(OPEN) + len(OPEN):-len(CLOSE)]
        result = calculate(expression)
        calls.append([expression, result])
        tool = await post(url + "/tokenize", {"prompt": f"<result>{result}</result>",
                                              "add_special_tokens": False})
        tokens += tool["tokens"]
        loss_mask += [0] * len(tool["tokens"])
        logprobs += [0.0] * len(tool["tokens"])
    response = await post(url + "/detokenize", {"tokens": tokens[prompt_length:]})
    sample.tokens = tokens
    sample.response_length = len(tokens) - prompt_length
    sample.response = response["text"]
    sample.loss_mask = loss_mask
    sample.rollout_log_probs = logprobs
    sample.status = status
    sample.metadata = dict(sample.metadata or {}, tool_calls=calls)
    return sample
