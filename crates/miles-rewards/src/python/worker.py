"""The worker behind `--custom-rm-path FILE.py:FUNCTION` and
`--custom-generate-function-path FILE.py:FUNCTION`: miles-rs writes this file out, runs
`python3 python_worker.py FILE FUNCTION` and talks to it in JSON lines; the protocol is
documented in crates/miles-rewards/src/python/mod.rs and generate.rs.

Where slime is not installed, `slime.utils.types` (Sample) and `slime.utils.http_utils` (post,
get) are provided here, so functions written for slime import unchanged.

Protocol lines go to a private copy of the original stdout; file descriptor 1 and `sys.stdout`
are pointed at stderr, so whatever the user's code prints (Python or C) cannot corrupt them.
"""

import asyncio
import concurrent.futures
import contextvars
import enum
import importlib.util
import inspect
import json
import math
import numbers
import os
import signal
import sys
import time
import traceback
import types
import urllib.error
import urllib.request

# Tracebacks written in full to stderr per worker; later ones only as their last line.
FULL_TRACEBACKS = 3
# Least time between two progress lines of one request, in seconds.
PROGRESS_EVERY = 1.0


def take_protocol_streams():
    """Private copies of stdin/stdout for the protocol; fd 0 reads nothing and fd 1 is stderr."""
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8", newline="\n")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdin = open(os.devnull, encoding="utf-8")
    sys.stdout = sys.stderr
    return proto_in, proto_out


PROTO_IN, PROTO_OUT = take_protocol_streams()


def send(message):
    try:
        PROTO_OUT.write(json.dumps(message, ensure_ascii=True, allow_nan=False) + "\n")
        PROTO_OUT.flush()
    except (BrokenPipeError, OSError):
        # miles is gone: nobody is left to answer.
        os._exit(0)


def print_traceback(exc):
    """The traceback on stderr, without the worker's own frames in front of the user's."""
    tb = exc.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename == __file__
        or tb.tb_frame.f_code.co_filename.startswith("<frozen ")
    ):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def last_line(exc):
    """The last line of the exception's traceback: `ValueError: message`."""
    lines = [
        line.strip()
        for line in "".join(traceback.format_exception_only(type(exc), exc)).splitlines()
        if line.strip()
    ]
    text = lines[-1] if lines else type(exc).__name__
    if isinstance(exc, SyntaxError) and exc.lineno is not None:
        text += f" ({exc.filename}, line {exc.lineno})"
    return text


class Status(str, enum.Enum):
    """slime's Sample.Status."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


class Sample(dict):
    """A sample as a dict that also reads as an object: `sample["response"]` and
    `sample.response` (slime's reward and generate functions use attributes)."""

    Status = Status

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"sample has no field '{key}' (it has: {', '.join(self)})")

    def __setattr__(self, key, value):
        self[key] = value


class Args(types.SimpleNamespace):
    """The reward's JSON configuration, as slime's `args`: `args.key` or `args["key"]`."""

    def __getitem__(self, key):
        return getattr(self, key)

    def get(self, key, default=None):
        return getattr(self, key, default)


# Threads for blocking HTTP calls of concurrent samples (post, get).
HTTP_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=256)
# The sample a generate function's task is making, and its /generate calls so far: `post`
# names each call `miles-sample-{index}-{turn}`, which keys the engine's draws, so a run
# draws the same tokens whatever order the samples' requests reach the engine in.
GENERATING = contextvars.ContextVar("generating", default=None)


def http_call(url, payload, timeout, retries):
    """A JSON request (POST when `payload` is not None) with retries on refused connections
    and 5xx answers; a 4xx answer raises at once with the server's message."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    for attempt in range(retries + 1):
        try:
            request = urllib.request.Request(url, data=data, headers=headers)
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                body = answer.read()
                return json.loads(body) if body else None
        except urllib.error.HTTPError as exc:
            body = exc.read().decode("utf-8", "replace")
            if exc.code < 500 or attempt == retries:
                raise RuntimeError(f"{url} answered {exc.code}: {body}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            if attempt == retries:
                raise RuntimeError(f"{url}: {exc}") from None
        time.sleep(min(0.1 * 2**attempt, 5.0))


async def post(url, payload, max_retries=60, timeout=3600, **_):
    """slime's `slime.utils.http_utils.post`: the JSON answer of a POST of `payload`."""
    sample = GENERATING.get()
    if sample is not None and url.rstrip("/").endswith("/generate") \
            and isinstance(payload, dict) and "rid" not in payload:
        payload = dict(payload, rid=f"miles-sample-{sample[0]}-{sample[1]}")
        sample[1] += 1
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(HTTP_POOL, http_call, url, payload, timeout, max_retries)


async def get(url, max_retries=60, timeout=3600, **_):
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(HTTP_POOL, http_call, url, None, timeout, max_retries)


def provide_slime():
    """`slime.utils.types.Sample` and `slime.utils.http_utils.post` where slime is absent."""
    try:
        import slime  # noqa: F401 - the real one wins
        return
    except ImportError:
        pass
    modules = {name: types.ModuleType(name) for name in
               ("slime", "slime.utils", "slime.utils.types", "slime.utils.http_utils")}
    modules["slime"].utils = modules["slime.utils"]
    modules["slime.utils"].types = modules["slime.utils.types"]
    modules["slime.utils"].http_utils = modules["slime.utils.http_utils"]
    modules["slime.utils.types"].Sample = Sample
    modules["slime.utils.http_utils"].post = post
    modules["slime.utils.http_utils"].get = get
    sys.modules.update(modules)


def load(path, name):
    """Imports the user's file by path and returns (module, function)."""
    if not os.path.isfile(path):
        raise SetupError(f"{path}: no such file")
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        # Lets the file import its neighbours, as `python FILE` would.
        sys.path.insert(0, directory)
    stem = os.path.splitext(os.path.basename(path))[0]
    module_name = stem if stem.isidentifier() and stem not in sys.modules else "miles_rm_user"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise SetupError(f"{path}: not importable as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001 - any failure to import is reported as such
        print_traceback(exc)
        raise SetupError(f"importing {path} failed: {last_line(exc)}") from None
    function = getattr(module, name, None)
    if function is None:
        defined = sorted(
            k
            for k, v in vars(module).items()
            if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module_name
        )
        listed = ", ".join(defined) if defined else "none"
        raise SetupError(f"{path} has no function '{name}' (functions it defines: {listed})")
    if not callable(function):
        raise SetupError(f"{path}: '{name}' is a {type(function).__name__}, not a function")
    return function


class SetupError(Exception):
    pass


def calling_convention(function, name):
    """How to call the function: `sample` (f(sample)), `args_sample` (slime's f(args, sample)),
    or `verl` (f(data_source, solution_str, ground_truth, extra_info))."""
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return "sample"
    names = [p.name for p in params]
    if "solution_str" in names:
        return "verl"
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    varargs = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params)
    if len(required) >= 2 or (positional and positional[0].name == "args"):
        return "args_sample"
    if not positional and not varargs:
        raise SetupError(
            f"'{name}' takes no positional argument; write it as {name}(sample) or "
            f"{name}(args, sample)"
        )
    return "sample"


def generate_convention(function, name):
    """A generate function takes (args, sample, sampling_params), as slime calls it."""
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return
    positional = [
        p for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if len(positional) < 3 and not any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        raise SetupError(
            f"'{name}' takes {len(positional)} positional arguments; a generate function is "
            f"{name}(args, sample, sampling_params), as slime calls it"
        )


def is_async(function):
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "__call__", None)
    )


def encode(value, name):
    """One result for the protocol: {"reward": number | {name: number}} or {"error": text}."""

    def number(x):
        if isinstance(x, bool):
            return float(x)
        if isinstance(x, numbers.Real):
            return float(x)
        item = getattr(x, "item", None)  # numpy / torch scalars
        if callable(item):
            try:
                inner = item()
            except Exception:  # noqa: BLE001 - not a scalar: reported below
                return None
            if isinstance(inner, numbers.Real):
                return float(inner)
        return None

    def describe(x):
        text = repr(x)
        if len(text) > 60:
            text = text[:57] + "..."
        return f"{type(x).__name__} {text}"

    if isinstance(value, dict):
        if not value:
            return {"error": f"{name} returned an empty dict; return a number or a dict of numbers"}
        named = {}
        for key, x in value.items():
            v = number(x)
            if v is None:
                return {
                    "error": f"{name} returned a dict whose '{key}' is {describe(x)}, not a number"
                }
            if not math.isfinite(v):
                return {"error": f"{name} returned a dict whose '{key}' is {v}, not a finite number"}
            named[str(key)] = v
        return {"reward": named}
    v = number(value)
    if v is None:
        return {
            "error": f"{name} returned {describe(value)}, not a number or a dict of numbers"
        }
    if not math.isfinite(v):
        return {"error": f"{name} returned {v}, not a finite number"}
    return {"reward": v}


def encode_sample(value, name, given):
    """A generate function's sample for the protocol: {"sample": {...}} or {"error": text}.
    `given` is the sample it was called with (its `tokens` the prompt's)."""

    def fail(text):
        return {"error": f"{name} returned {text}"}

    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            return fail(f"{len(value)} samples; miles takes one sample back for each it gives")
        value = value[0]
    if not isinstance(value, dict):
        fields = ("tokens", "response", "response_length", "loss_mask", "rollout_log_probs",
                  "status", "metadata")
        if not hasattr(value, "tokens"):
            return fail(f"{type(value).__name__}, not a sample")
        value = {k: getattr(value, k) for k in fields if hasattr(value, k)}
    tokens = value.get("tokens")
    if not isinstance(tokens, (list, tuple)):
        return fail(f"a sample whose tokens are {type(tokens).__name__}, not a list of token ids")
    try:
        tokens = [int(t) for t in tokens]
    except (TypeError, ValueError):
        return fail("a sample whose tokens are not all integers")
    if any(t < 0 or t >= 2**32 for t in tokens):
        return fail("a sample with a negative (or too large) token id")
    length = value.get("response_length")
    grown = len(tokens) - len(given.get("tokens") or [])
    if length is None or (length == 0 and grown > 0):
        # Left as it was given (0): the tokens past the prompt's.
        length = grown
    if isinstance(length, bool) or not isinstance(length, numbers.Integral) \
            or not 0 <= length <= len(tokens):
        return fail(f"response_length {length!r} for {len(tokens)} tokens")
    length = int(length)
    out = {"tokens": tokens, "response_length": length}
    response = value.get("response", "")
    if not isinstance(response, str):
        return fail(f"a response of type {type(response).__name__}, not text")
    out["response"] = response
    for key, kind in (("loss_mask", "0 or 1"), ("rollout_log_probs", "a finite number")):
        items = value.get(key)
        if items is None or (len(items) == 0 and length > 0):
            continue  # not given: all trained / the engine's
        if len(items) != length:
            return fail(f"{len(items)} {key} for a response of {length} tokens")
        try:
            items = [float(x) for x in items]
        except (TypeError, ValueError):
            return fail(f"{key} that are not all {kind}")
        if key == "loss_mask" and any(x not in (0.0, 1.0) for x in items):
            return fail("a loss_mask with a value other than 0 or 1")
        if not all(math.isfinite(x) for x in items):
            return fail(f"{key} that are not all {kind}")
        out[key] = [int(x) for x in items] if key == "loss_mask" else items
    status = value.get("status", "completed")
    status = getattr(status, "value", status)
    if status not in {s.value for s in Status}:
        return fail(f"status {status!r}, not one of {', '.join(s.value for s in Status)}")
    out["status"] = "completed" if status == "pending" else status
    metadata = value.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            return fail(f"metadata of type {type(metadata).__name__}, not a dict")
        try:
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as exc:
            return fail(f"metadata that is not JSON: {exc}")
        out["metadata"] = metadata
    return {"sample": out}


class Worker:
    def __init__(self, function, name, args, mode="reward"):
        self.function = function
        self.name = name
        self.args = args
        self.mode = mode
        if mode == "generate":
            generate_convention(function, name)
            self.convention = "args_sample_params"
        else:
            self.convention = calling_convention(function, name)
        # One event loop for the worker's life, made when first needed: clients that async
        # functions keep between calls (an aiohttp session) are bound to it.
        self.event_loop = None
        self.tracebacks = 0

    def loop(self):
        if self.event_loop is None:
            self.event_loop = asyncio.new_event_loop()
        return self.event_loop

    def close(self):
        if self.event_loop is not None:
            self.event_loop.close()

    def call(self, payload):
        """Calls the user's function on one sample (or one group, a list)."""
        if self.convention == "args_sample_params":
            return self.function(self.args, payload, dict(self.sampling_params))
        if self.convention == "args_sample":
            return self.function(self.args, payload)
        if self.convention == "verl":
            metadata = payload.get("metadata") if isinstance(payload, dict) else None
            metadata = metadata if isinstance(metadata, dict) else {}
            kwargs = {
                "data_source": metadata.get("data_source"),
                "solution_str": payload["response"],
                "ground_truth": payload["label"],
                "extra_info": metadata,
            }
            params = inspect.signature(self.function).parameters
            if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
                kwargs = {k: v for k, v in kwargs.items() if k in params}
            return self.function(**kwargs)
        return self.function(payload)

    def failure(self, exc):
        """The per-sample error of an exception; the first few are printed in full."""
        self.tracebacks += 1
        if self.tracebacks <= FULL_TRACEBACKS:
            print_traceback(exc)
            if self.tracebacks == FULL_TRACEBACKS:
                print("(further tracebacks are not printed)", file=sys.stderr)
        return {"error": last_line(exc)}

    def settle(self, result):
        if inspect.isawaitable(result):
            return self.loop().run_until_complete(result)
        return result

    def score(self, request):
        samples = [Sample(s) for s in request["samples"]]
        self.sampling_params = request.get("sampling_params") or {}
        progress = Progress(request["id"])
        if request.get("group"):
            try:
                results = self.settle(self.call(samples))
            except BaseException as exc:  # noqa: BLE001 - fails the group, not the worker
                return {"id": request["id"], "error": self.failure(exc)["error"]}
            if not isinstance(results, (list, tuple)):
                return {
                    "id": request["id"],
                    "error": f"{self.name} was given a group of {len(samples)} samples and "
                    f"returned {type(results).__name__}, not a list of rewards",
                }
            if len(results) != len(samples):
                return {
                    "id": request["id"],
                    "error": f"{self.name} was given a group of {len(samples)} samples and "
                    f"returned {len(results)} rewards",
                }
            return {"id": request["id"], "results": [encode(r, self.name) for r in results]}
        if is_async(self.function):
            results = self.loop().run_until_complete(self.gather(samples, progress))
        else:
            results = []
            for sample in samples:
                results.append(self.one(sample))
                progress.done()
        return {"id": request["id"], "results": results}

    def encode(self, result, sample):
        if self.mode == "generate":
            return encode_sample(result, self.name, sample)
        return encode(result, self.name)

    def one(self, sample):
        given = {"tokens": list(sample.get("tokens") or [])}
        try:
            return self.encode(self.settle(self.call(sample)), given)
        except BaseException as exc:  # noqa: BLE001 - fails this sample only
            return self.failure(exc)

    async def gather(self, samples, progress):
        async def one(sample):
            given = {"tokens": list(sample.get("tokens") or [])}
            if self.mode == "generate":
                GENERATING.set([sample.get("index", 0), 0])
            try:
                result = self.call(sample)
                if inspect.isawaitable(result):
                    result = await result
                out = self.encode(result, given)
            except BaseException as exc:  # noqa: BLE001 - fails this sample only
                out = self.failure(exc)
            progress.done()
            return out

        return await asyncio.gather(*(one(s) for s in samples))


class Progress:
    """Tells miles that samples are being finished, so a slow batch is not taken for a hung one."""

    def __init__(self, request_id):
        self.request_id = request_id
        self.count = 0
        self.last = time.monotonic()

    def done(self):
        self.count += 1
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY:
            self.last = now
            send({"id": self.request_id, "progress": self.count})


def main():
    # Ctrl-C reaches miles, which closes our stdin; a KeyboardInterrupt here would only
    # print a traceback in the middle of a batch.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if len(sys.argv) != 3:
        send({"ready": False, "error": "usage: python_worker.py FILE FUNCTION"})
        return 2
    path, name = sys.argv[1], sys.argv[2]
    init = PROTO_IN.readline()
    if not init:
        return 0
    init = json.loads(init)
    config = init.get("args") or {}
    mode = init.get("mode") or "reward"
    try:
        provide_slime()
        function = load(path, name)
        worker = Worker(function, name, Args(**config), mode)
    except SetupError as exc:
        send({"ready": False, "error": str(exc)})
        return 1
    send(
        {
            "ready": True,
            "python": sys.version.split()[0],
            "function": name,
            "call": worker.convention,
            "async": is_async(function),
        }
    )
    for line in PROTO_IN:
        if not line.strip():
            continue
        request = json.loads(line)
        send(worker.score(request))
    worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
