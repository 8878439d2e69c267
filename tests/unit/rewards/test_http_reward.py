"""`data.reward=http` against a real HTTP server on this machine (`http.server` in a thread): the
responses go in batches of `data.reward_batch_size`, a 5xx is retried after the back-off, a 4xx or
a malformed answer fails at once, an unreachable or silent service fails after its tries, each
failure said in one line naming the service, the prompts and the cause."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moe_rl.config.modes import RewardPool
from moe_rl.config.schema import DataConfig, RecipeConfig
from moe_rl.errors import RewardFunctionError
from moe_rl.rewards import ByteTokenizer, RewardScorer
from moe_rl.rewards.registry import reward_rules
from moe_rl.rewards.tasks import EOS, Prompt

TOK = ByteTokenizer()
DEADLINE_S = 60.0


@dataclass
class Service:
    """What the server answers (``statuses`` in turn, then 200 with each item's exact match, or
    ``body`` when set) and what it was asked (each request's items)."""

    statuses: list[int] = field(default_factory=list)
    body: bytes | None = None
    silent: threading.Event | None = None
    """Set: the server answers nothing until the event is set."""
    requests: list[list[dict]] = field(default_factory=list)
    url: str = ""

    def answer(self, items: list[dict]) -> tuple[int, bytes]:
        self.requests.append(items)
        if self.silent is not None:
            self.silent.wait(DEADLINE_S)
        if self.statuses:
            return self.statuses.pop(0), b"busy, try again"
        rewards = [float(item["response"] == item["answer"]) for item in items]
        return 200, self.body if self.body is not None else json.dumps({"rewards": rewards}).encode()


@pytest.fixture
def service() -> Iterator[Service]:
    state = Service()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
            status, body = state.answer(items)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # quiet
            pass

    class Server(ThreadingHTTPServer):
        def handle_error(self, request, client_address) -> None:  # a client gone before its answer
            pass

    server = Server(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/score"
    yield state
    if state.silent is not None:
        state.silent.set()
    server.shutdown()
    server.server_close()
    thread.join(DEADLINE_S)


def _scorer(url: str, **keys) -> RewardScorer:
    keys = {"reward_workers": 1, "reward_backoff_s": 0.01, **keys}
    return RewardScorer("http", tokenizer=TOK, data=DataConfig(reward="http", reward_url=url, **keys))


def _batch(answers: list[str], said: list[str], group_size: int):
    """Prompt i answered ``answers[i]``; its ``group_size`` responses say ``said`` in turn."""
    prompts = [Prompt(ids=tuple(TOK.encode_prompt(f"{i}+1=")), answer=a) for i, a in enumerate(answers)]
    per_response = [p for p in prompts for _ in range(group_size)]
    texts = [said[k % len(said)] for k in range(len(per_response))]
    return per_response, [[*TOK.encode(t)[1:], EOS] for t in texts]


def test_responses_go_in_batches_and_a_5xx_is_retried(service):
    service.statuses = [503]  # the first request: the service is busy
    prompts, responses = _batch(["1", "2", "3", "4", "5"], ["1", "2"], group_size=2)
    scores = _scorer(service.url, reward_batch_size=4).score_batch(prompts, responses, 2)
    assert scores.values == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0] and scores.failed == 0
    assert [len(items) for items in service.requests] == [4, 4, 4, 2]  # the first batch twice
    assert service.requests[0] == service.requests[1]
    assert service.requests[0][0] == {"prompt": "0+1=", "response": "1", "answer": "1"}
    assert [item["answer"] for items in service.requests[1:] for item in items] == [
        a for a in ["1", "2", "3", "4", "5"] for _ in range(2)
    ]


def test_requests_run_reward_workers_at_a_time(service):
    service.silent = threading.Event()  # holds every request until it is set
    prompts, responses = _batch(["1", "2", "3"], ["1"], group_size=2)
    scorer = _scorer(service.url, reward_batch_size=2, reward_workers=3)
    done = threading.Thread(target=lambda: scorer.score_batch(prompts, responses, 2), daemon=True)
    done.start()
    for _ in range(int(DEADLINE_S / 0.05)):  # all three requests arrive before any is answered
        if len(service.requests) == 3:
            break
        threading.Event().wait(0.05)
    assert len(service.requests) == 3, service.requests
    service.silent.set()
    done.join(DEADLINE_S)
    assert not done.is_alive()


def test_a_4xx_fails_at_once_with_one_line(service):
    service.statuses = [400]
    prompts, responses = _batch(["1", "2"], ["1"], group_size=2)
    with pytest.raises(RewardFunctionError) as err:
        _scorer(service.url, reward_batch_size=8).score_batch(prompts, responses, 2)
    assert str(err.value) == (
        f"reward service data.reward=http at {service.url} answered HTTP 400 Bad Request: "
        "'busy, try again' (prompts 0-1, responses 0-3)"
    )
    assert len(service.requests) == 1  # not retried


def test_an_answer_that_is_not_every_items_reward_fails(service):
    service.body = json.dumps({"rewards": [1.0]}).encode()
    prompts, responses = _batch(["1"], ["1"], group_size=2)
    with pytest.raises(RewardFunctionError, match=r"answered 1 rewards for 2 responses \(prompts 0-0, "):
        _scorer(service.url).score_batch(prompts, responses, 2)


def test_a_service_still_failing_after_its_retries_is_named_with_its_tries(service):
    service.statuses = [503, 502, 500]
    prompts, responses = _batch(["1"], ["1"], group_size=2)
    with pytest.raises(RewardFunctionError) as err:
        _scorer(service.url, reward_retries=2).score_batch(prompts, responses, 2)
    assert (
        "answered HTTP 500 Internal Server Error: 'busy, try again' (3 tries, data.reward_retries=2)"
        in str(err.value)
    )
    assert len(service.requests) == 3


def test_a_silent_service_times_out_and_is_retried(service):
    service.silent = threading.Event()
    prompts, responses = _batch(["1"], ["1"], group_size=1)
    with pytest.raises(RewardFunctionError) as err:
        _scorer(service.url, reward_timeout_s=1.0, reward_retries=1).score_batch(prompts, responses, 1)
    assert "could not be reached: TimeoutError" in str(err.value) and "(2 tries" in str(err.value)
    assert len(service.requests) == 2


def test_an_unreachable_service_is_named(service):
    url = service.url.replace("/score", "").rsplit(":", 1)[0] + ":9/score"  # the discard port: refused
    prompts, responses = _batch(["1"], ["1"], group_size=1)
    with pytest.raises(RewardFunctionError, match=r"at http://127.0.0.1:9/score could not be reached: "):
        _scorer(url, reward_retries=1).score_batch(prompts, responses, 1)


def _rules(**data) -> list[str]:
    config = RecipeConfig(data=DataConfig(task="file:x.jsonl", **data))
    return [rule.message for rule in reward_rules(config) if rule.broken]


def test_the_service_keys_are_checked_before_the_run():
    assert _rules(reward="http", reward_url="http://judge:8000/score") == []
    assert _rules(reward="http") == [
        "reward service: data.reward_url=None: data.reward=http needs an http(s)://HOST[:PORT]/PATH URL"
    ]
    assert _rules(reward="http", reward_url="judge:8000") == [
        "reward service: data.reward_url=judge:8000: data.reward=http needs an http(s)://HOST[:PORT]/PATH URL"
    ]
    assert _rules(reward="math", reward_url="http://judge/score") == [
        "reward service: data.reward_url=http://judge/score, data.reward=math: the URL is read by "
        "data.reward=http only: set that, or remove data.reward_url"
    ]
    assert _rules(reward="http", reward_url="http://judge/score", reward_pool=RewardPool.PROCESS) == [
        "reward service: data.reward_url=http://judge/score, data.reward_pool=process: requests wait on "
        "the network in threads: set data.reward_pool=thread"
    ]


def _direct(url: str, *, retries: int, timeout_s: float | None = 5.0, backoff_s: float = 0.25):
    from moe_rl.rewards.http import HttpReward

    return HttpReward(url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The back-off waits a call asks for, in order (recorded, not slept)."""
    from moe_rl.rewards import http

    asked: list[float] = []
    monkeypatch.setattr(http.time, "sleep", asked.append)
    return asked


def test_the_back_off_doubles_before_each_next_try_and_none_comes_before_the_first(service, waits):
    service.statuses = [503, 503, 503]
    reward = _direct(service.url, retries=3)
    assert reward([{"prompt": "p", "response": "1", "answer": "1"}]) == [1.0]
    assert waits == [0.25, 0.5, 1.0] and len(service.requests) == 4


@pytest.mark.parametrize(
    ("status", "retried"), [(429, True), (428, False), (430, False), (499, False), (500, True), (404, False)]
)
def test_a_429_and_a_5xx_are_retried_every_other_4xx_fails_at_once(service, waits, status, retried):
    from moe_rl.rewards.pool import CallError

    service.statuses = [status]
    reward = _direct(service.url, retries=1)
    item = [{"prompt": "p", "response": "1", "answer": "1"}]
    if retried:
        assert reward(item) == [1.0] and len(service.requests) == 2
    else:
        with pytest.raises(CallError, match=f"answered HTTP {status} "):
            reward(item)
        assert len(service.requests) == 1 and waits == []


def test_one_try_is_said_in_the_singular(service, waits):
    from moe_rl.rewards.pool import CallError

    service.statuses = [503]
    with pytest.raises(CallError, match=r"\(1 try, data.reward_retries=0\)$"):
        _direct(service.url, retries=0)([{"prompt": "p", "response": "1", "answer": "1"}])


def test_the_longest_a_call_takes_counts_every_try_at_both_limits_and_the_waits():
    # 3 tries, each up to 5 s to connect and 5 s to be answered, and waits of 0.25 + 0.5
    assert _direct("http://x/s", retries=2).longest_s() == pytest.approx(3 * 2 * 5.0 + 0.75)
    assert _direct("http://x/s", retries=0, backoff_s=9.0).longest_s() == pytest.approx(10.0)
    assert _direct("http://x/s", retries=2, timeout_s=None).longest_s() is None


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b"not json", "answered 'not json', not {\"rewards\": [...]}"),
        (b'{"scores": [1.0]}', 'not {"rewards": [...]}'),
        (b'["rewards"]', 'not {"rewards": [...]}'),
        (b'{"rewards": [1.0, NaN]}', "answered nan for item 1; every reward must be a finite number"),
        (b'{"rewards": [Infinity, 1.0]}', "answered inf for item 0; every reward must be a finite number"),
        (b'{"rewards": [1.0, "1"]}', "answered '1' for item 1; every reward must be a finite number"),
        (b'{"rewards": 2}', "answered 2 for 2 responses"),
    ],
)
def test_an_answer_other_than_finite_rewards_fails_at_once_saying_what_came(service, waits, body, said):
    from moe_rl.rewards.pool import CallError

    service.body = body
    items = [{"prompt": "p", "response": "1", "answer": "1"}] * 2
    with pytest.raises(CallError) as err:
        _direct(service.url, retries=2)(items)
    assert said in str(err.value) and len(service.requests) == 1


def test_an_answer_is_quoted_up_to_its_first_200_characters():
    from moe_rl.rewards.http import BODY_SHOWN, _shown

    assert BODY_SHOWN == 200
    assert _shown(b"a" * 200) == repr("a" * 200)
    assert _shown(b"a" * 201) == repr("a" * 200 + "...")
