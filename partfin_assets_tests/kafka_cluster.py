"""librdkafka's mock Kafka cluster in a helper process, for tests: real Kafka protocol on 127.0.0.1.

Kafka's own broker cannot be installed here, but librdkafka (the C library under confluent-kafka)
ships a mock cluster: N brokers that speak the Kafka protocol over TCP on loopback (produce,
fetch, consumer groups with offset commits, idempotent and transactional producers). It is
created through librdkafka's experimental C API (`rdkafka_mock.h`), reached with ctypes from the
same shared library the confluent-kafka wheel loads, so client and broker are one version.

The cluster lives in a helper process (this file run as a script with the venv's python):
- it prints the bootstrap servers on its first stdout line once the brokers listen;
- it then serves control commands, one JSON line each on stdin, answering one JSON line on
  stdout: topic creation and fault injection (`MockKafkaCluster` below wraps them);
- it stays up until killed (`MockKafkaCluster.stop` sends SIGTERM by PID and reaps it), and it
  exits by itself when its parent goes away (parent PID watched; stdin closed), so a killed
  pytest leaves neither an orphan nor a zombie behind.

What the mock does not do (test_kafka_cluster.py::test_what_the_mock_does_not_do pins the API
ones): no admin APIs (CreateTopics, CreatePartitions, DeleteRecords, configs, group listing):
topics come from `create_topic` here, and a topic never grows; no offsets-for-times; no SASL or
TLS; transactions commit and abort, but read_committed consumers still see aborted records; no compaction or time retention, but each partition keeps only its last 5 MB (or 100,000
record batches), dropping older batches; it refuses group offset commits while the group is
rebalancing (Kafka accepts them from current members); a group rebalance waits the members'
session timeout less 1 s (see FAST_GROUP_SETTINGS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# Kafka protocol request types (ApiKey), for request-error injection and request tracking.
API_KEYS = {
    "Produce": 0, "Fetch": 1, "ListOffsets": 2, "Metadata": 3, "OffsetCommit": 8, "OffsetFetch": 9,
    "FindCoordinator": 10, "JoinGroup": 11, "Heartbeat": 12, "LeaveGroup": 13, "SyncGroup": 14,
    "ApiVersion": 18, "InitProducerId": 22, "OffsetForLeaderEpoch": 23, "AddPartitionsToTxn": 24,
    "AddOffsetsToTxn": 25, "EndTxn": 26, "TxnOffsetCommit": 28, "ConsumerGroupHeartbeat": 68,
}
ALL_BROKERS = -1
# Consumer-group settings that keep group tests quick on the mock: when a member joins or leaves a
# stable group, the mock coordinator waits session.timeout.ms - 1 s for the others to rejoin
# (44 s with librdkafka's default 45 s); a member killed with -9 is noticed only after its session
# timeout; new partitions and topics are seen on the next metadata refresh (default 5 minutes).
FAST_GROUP_SETTINGS = {
    "session.timeout.ms": 3000,
    "heartbeat.interval.ms": 300,
    "topic.metadata.refresh.interval.ms": 500,
}


class MockKafkaError(RuntimeError):
    """The helper process failed to start, died, or a mock call returned a Kafka error."""


def librdkafka_path() -> str:
    """The librdkafka shared library that confluent-kafka loads (its wheel's copy), else the system's."""
    spec = importlib.util.find_spec("confluent_kafka")
    if spec is not None and spec.submodule_search_locations:
        package_dir = Path(next(iter(spec.submodule_search_locations)))
        bundled = sorted((package_dir.parent / "confluent_kafka.libs").glob("librdkafka*.so*"))
        if bundled:
            return str(bundled[0])
    system = ctypes.util.find_library("rdkafka")  # Debian's librdkafka1
    if system is None:
        raise MockKafkaError("librdkafka not found: install confluent-kafka (its wheel bundles it) or Debian's librdkafka1")
    return system


# ---------------------------------------------------------------------------------------------
# The test side: start, control and stop the helper process.


@dataclass
class TrackedRequest:
    broker_id: int
    api_key: int
    timestamp_us: int


class MockKafkaCluster:
    """A running mock cluster: its bootstrap servers, its helper's PID, and its control calls.

    Broker ids run from 1 to `broker_count`. Every control call is synchronous: it has taken
    effect in the cluster when it returns, and it raises MockKafkaError with librdkafka's error
    name when the mock refuses it.
    """

    def __init__(self, process: subprocess.Popen, bootstrap_servers: str, broker_count: int, log_path: Path):
        self._process = process
        self._lock = threading.Lock()
        self.bootstrap_servers = bootstrap_servers
        self.broker_count = broker_count
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self._process.pid

    def client_config(self, **overrides) -> dict:
        """A confluent-kafka config for this cluster plus `overrides` (librdkafka property names:
        `client_config(**{"group.id": "g"})`)."""
        return {"bootstrap.servers": self.bootstrap_servers, **overrides}

    # topics -----------------------------------------------------------------------------------
    def create_topic(self, topic: str, partitions: int, replication_factor: int | None = None) -> None:
        """A new topic (the mock has no CreateTopics API; AdminClient.create_topics fails)."""
        rf = min(3, self.broker_count) if replication_factor is None else replication_factor
        self._call("topic_create", topic, partitions, rf)

    def delete_topic(self, topic: str) -> None:
        self._call("topic_delete", topic)

    def set_topic_error(self, topic: str, error: int | str) -> None:
        """Metadata requests for `topic` answer `error` (0 clears it)."""
        self._call("topic_set_error", topic, _error_code(error))

    # partitions -------------------------------------------------------------------------------
    def set_partition_leader(self, topic: str, partition: int, broker_id: int) -> None:
        """Move the partition's leader; -1 leaves it leaderless: produce and fetch on it stall
        (clients retry) until a leader is set again, the other partitions go on."""
        self._call("partition_set_leader", topic, partition, broker_id)

    def delete_records(self, topic: str, partition: int, before_offset: int) -> None:
        """Advance the partition's log start offset (what retention does on a real broker)."""
        self._call("partition_delete_records", topic, partition, before_offset)

    def push_partition_errors(self, topic: str, partition: int, api: str, errors: Sequence[int | str]) -> None:
        """The next len(errors) `api` requests touching this partition get these partition-level errors."""
        self._call("partition_push_request_errors", topic, partition, API_KEYS[api], len(errors),
                   *(_error_code(e) for e in errors))

    # brokers ----------------------------------------------------------------------------------
    def broker_down(self, broker_id: int = ALL_BROKERS) -> None:
        """Close the broker's connections and refuse new ones; its partitions keep it as leader."""
        self._call("broker_set_down", broker_id)

    def broker_up(self, broker_id: int = ALL_BROKERS) -> None:
        self._call("broker_set_up", broker_id)

    def set_broker_rtt(self, broker_id: int, rtt_ms: int) -> None:
        """Delay every response of the broker (ALL_BROKERS for all) by rtt_ms."""
        self._call("broker_set_rtt", broker_id, rtt_ms)

    def decommission_broker(self, broker_id: int) -> None:
        """Remove the broker; its partitions get other leaders."""
        self._call("broker_decommission", broker_id)

    def add_broker(self, broker_id: int) -> None:
        """Add a broker; partitions are spread over it too."""
        self._call("broker_add", broker_id)

    def push_broker_errors(self, broker_id: int, api: str, errors_and_rtts: Sequence[tuple[int | str, int]]) -> None:
        """The broker's next `api` requests answer (error, after rtt_ms) from this list, in order."""
        flat = [value for error, rtt in errors_and_rtts for value in (_error_code(error), int(rtt))]
        self._call("broker_push_request_error_rtts", broker_id, API_KEYS[api], len(errors_and_rtts), *flat)

    # cluster-wide -----------------------------------------------------------------------------
    def push_request_errors(self, api: str, errors: Sequence[int | str]) -> None:
        """The next len(errors) `api` requests, to any broker, fail with these errors in order
        ("_TRANSPORT" disconnects the client)."""
        self._call("push_request_errors", API_KEYS[api], [_error_code(e) for e in errors])

    def clear_request_errors(self, api: str) -> None:
        self._call("clear_request_errors", API_KEYS[api])

    def set_coordinator(self, key_type: str, key: str, broker_id: int) -> None:
        """Pin the coordinator of a group ("group", group id) or a transactional id ("transaction")."""
        self._call("coordinator_set", key_type, key, broker_id)

    def set_group_initial_rebalance_delay_ms(self, delay_ms: int) -> None:
        """Kafka's group.initial.rebalance.delay.ms: how long the first join of an empty group waits."""
        self._call("group_initial_rebalance_delay_ms", delay_ms)

    def start_request_tracking(self) -> None:
        self._call("start_request_tracking")

    def stop_request_tracking(self) -> None:
        self._call("stop_request_tracking")

    def tracked_requests(self, *, clear: bool = True) -> list[TrackedRequest]:
        """The requests the brokers received since tracking started (or the last clear)."""
        rows = self._call("tracked_requests", clear)
        return [TrackedRequest(*row) for row in rows]

    # process ----------------------------------------------------------------------------------
    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM by PID, SIGKILL if it lingers, reap it (no zombie), remove its log."""
        stop_process(self._process, timeout_s)
        shutil.rmtree(self.log_path.parent, ignore_errors=True)

    def _call(self, command: str, *args):
        with self._lock:
            if self._process.poll() is not None:
                raise MockKafkaError(f"mock Kafka helper (pid {self.pid}) has exited: {_log_tail(self.log_path)}")
            self._process.stdin.write(json.dumps([command, *args]) + "\n")
            self._process.stdin.flush()
            line = _read_line(self._process, timeout_s=30.0, log_path=self.log_path)
        answer = json.loads(line)
        if "error" in answer:
            raise MockKafkaError(f"mock {command}{tuple(args)}: {answer['error']}")
        return answer.get("result")


def _error_code(error: int | str) -> int:
    """An rd_kafka_resp_err_t code, given as one or by its confluent_kafka.KafkaError name ("_TRANSPORT")."""
    from confluent_kafka import KafkaError

    return error if isinstance(error, int) else getattr(KafkaError, error)


@contextmanager
def mock_kafka_cluster(brokers: int = 3, *, initial_rebalance_delay_ms: int = 0,
                       start_timeout_s: float = 30.0) -> Iterator[MockKafkaCluster]:
    """A mock cluster of `brokers` brokers on 127.0.0.1 in a helper process, stopped on exit.

    initial_rebalance_delay_ms: the mock (like Kafka) makes the first member of a new group wait
    3000 ms for others before the first assignment; tests default to 0.
    """
    cluster = start_mock_kafka_cluster(brokers, start_timeout_s=start_timeout_s)
    try:
        cluster.set_group_initial_rebalance_delay_ms(initial_rebalance_delay_ms)
        yield cluster
    finally:
        cluster.stop()


def start_mock_kafka_cluster(brokers: int = 3, *, start_timeout_s: float = 30.0) -> MockKafkaCluster:
    log_dir = Path(tempfile.mkdtemp(prefix="partfin-kafka-"))
    log_path = log_dir / "mock-cluster.log"
    with open(log_path, "wb") as log:  # stderr to a file: a full, unread pipe would block librdkafka's log calls
        process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--brokers", str(brokers), "--parent-pid", str(os.getpid()),
             "--log-dir", str(log_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
            start_new_session=True,  # a Ctrl-C in the terminal reaches pytest, which then stops us by PID
        )
    try:
        bootstrap_servers = _read_line(process, timeout_s=start_timeout_s, log_path=log_path).strip()
    except BaseException:
        stop_process(process, 5.0)
        raise
    return MockKafkaCluster(process, bootstrap_servers, brokers, log_path)


def stop_process(process: subprocess.Popen, timeout_s: float) -> None:
    if process.poll() is None:
        try:
            os.kill(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            stream.close()


def _read_line(process: subprocess.Popen, *, timeout_s: float, log_path: Path) -> str:
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    line = process.stdout.readline() if ready else ""
    if not line:
        state = "exited" if process.poll() is not None else f"did not answer within {timeout_s:.0f}s"
        raise MockKafkaError(f"mock Kafka helper (pid {process.pid}) {state}: {_log_tail(log_path)}")
    return line


def _log_tail(log_path: Path) -> str:
    try:
        return log_path.read_text(errors="replace")[-2000:].strip() or "(empty log)"
    except FileNotFoundError:
        return "(no log)"


# ---------------------------------------------------------------------------------------------
# The helper process: owns the mock cluster, serves control commands.

_c = ctypes
_ERR = _c.c_int  # rd_kafka_resp_err_t
# command -> (librdkafka function, return type, argument types after the cluster pointer);
# variadic functions take their extra ints after these.
_MOCK_FUNCTIONS = {
    "topic_create": ("rd_kafka_mock_topic_create", _ERR, [_c.c_char_p, _c.c_int, _c.c_int]),
    "topic_delete": ("rd_kafka_mock_topic_delete", _ERR, [_c.c_char_p]),
    "topic_set_error": ("rd_kafka_mock_topic_set_error", None, [_c.c_char_p, _ERR]),
    "partition_delete_records": ("rd_kafka_mock_partition_delete_records", _ERR, [_c.c_char_p, _c.c_int32, _c.c_int64]),
    "partition_set_leader": ("rd_kafka_mock_partition_set_leader", _ERR, [_c.c_char_p, _c.c_int32, _c.c_int32]),
    "partition_push_request_errors": ("rd_kafka_mock_partition_push_request_errors", _ERR,
                                      [_c.c_char_p, _c.c_int32, _c.c_int16, _c.c_size_t]),
    "broker_set_down": ("rd_kafka_mock_broker_set_down", _ERR, [_c.c_int32]),
    "broker_set_up": ("rd_kafka_mock_broker_set_up", _ERR, [_c.c_int32]),
    "broker_set_rtt": ("rd_kafka_mock_broker_set_rtt", _ERR, [_c.c_int32, _c.c_int]),
    "broker_decommission": ("rd_kafka_mock_broker_decommission", _ERR, [_c.c_int32]),
    "broker_add": ("rd_kafka_mock_broker_add", _ERR, [_c.c_int32]),
    "broker_push_request_error_rtts": ("rd_kafka_mock_broker_push_request_error_rtts", _ERR,
                                       [_c.c_int32, _c.c_int16, _c.c_size_t]),
    "clear_request_errors": ("rd_kafka_mock_clear_request_errors", None, [_c.c_int16]),
    "coordinator_set": ("rd_kafka_mock_coordinator_set", _ERR, [_c.c_char_p, _c.c_char_p, _c.c_int32]),
    "group_initial_rebalance_delay_ms": ("rd_kafka_mock_group_initial_rebalance_delay_ms", None, [_c.c_int32]),
    "start_request_tracking": ("rd_kafka_mock_start_request_tracking", None, []),
    "stop_request_tracking": ("rd_kafka_mock_stop_request_tracking", None, []),
}


class _Helper:
    def __init__(self, brokers: int):
        lib = self.lib = ctypes.CDLL(librdkafka_path())
        lib.rd_kafka_conf_new.restype = _c.c_void_p
        lib.rd_kafka_conf_set.argtypes = [_c.c_void_p, _c.c_char_p, _c.c_char_p, _c.c_char_p, _c.c_size_t]
        lib.rd_kafka_new.restype = _c.c_void_p
        lib.rd_kafka_new.argtypes = [_c.c_int, _c.c_void_p, _c.c_char_p, _c.c_size_t]
        lib.rd_kafka_err2name.restype = _c.c_char_p
        lib.rd_kafka_err2name.argtypes = [_ERR]
        lib.rd_kafka_mock_cluster_new.restype = _c.c_void_p
        lib.rd_kafka_mock_cluster_new.argtypes = [_c.c_void_p, _c.c_int]
        lib.rd_kafka_mock_cluster_bootstraps.restype = _c.c_char_p
        lib.rd_kafka_mock_cluster_bootstraps.argtypes = [_c.c_void_p]
        lib.rd_kafka_mock_push_request_errors_array.argtypes = [_c.c_void_p, _c.c_int16, _c.c_size_t, _c.POINTER(_ERR)]
        lib.rd_kafka_mock_push_request_errors_array.restype = None
        lib.rd_kafka_mock_get_requests.restype = _c.POINTER(_c.c_void_p)
        lib.rd_kafka_mock_get_requests.argtypes = [_c.c_void_p, _c.POINTER(_c.c_size_t)]
        lib.rd_kafka_mock_request_id.restype = _c.c_int32
        lib.rd_kafka_mock_request_api_key.restype = _c.c_int16
        lib.rd_kafka_mock_request_timestamp.restype = _c.c_int64
        for name in ("rd_kafka_mock_request_id", "rd_kafka_mock_request_api_key", "rd_kafka_mock_request_timestamp"):
            getattr(lib, name).argtypes = [_c.c_void_p]
        lib.rd_kafka_mock_request_destroy_array.argtypes = [_c.POINTER(_c.c_void_p), _c.c_size_t]
        lib.rd_kafka_mock_clear_requests.argtypes = [_c.c_void_p]
        self.functions = {}
        for command, (name, restype, argtypes) in _MOCK_FUNCTIONS.items():
            function = getattr(lib, name)
            function.restype = restype
            function.argtypes = [_c.c_void_p, *argtypes]  # extra (variadic) ints pass as C ints
            self.functions[command] = function

        errstr = ctypes.create_string_buffer(512)
        conf = lib.rd_kafka_conf_new()
        # the handle only hosts the mock cluster; it never connects anywhere
        lib.rd_kafka_conf_set(conf, b"client.id", b"partfin-mock-cluster", errstr, len(errstr))
        lib.rd_kafka_conf_set(conf, b"log_level", b"3", errstr, len(errstr))  # no "no bootstrap.servers" notice
        self.rk = lib.rd_kafka_new(0, conf, errstr, len(errstr))  # RD_KAFKA_PRODUCER
        if not self.rk:
            raise MockKafkaError(f"rd_kafka_new: {errstr.value.decode()}")
        self.cluster = lib.rd_kafka_mock_cluster_new(self.rk, brokers)
        if not self.cluster:
            raise MockKafkaError("rd_kafka_mock_cluster_new failed (see the log above)")

    def bootstrap_servers(self) -> str:
        return self.lib.rd_kafka_mock_cluster_bootstraps(self.cluster).decode()

    def run(self, command: str, args: list):
        if command == "push_request_errors":
            api_key, errors = args
            array = (_ERR * len(errors))(*errors)
            self.lib.rd_kafka_mock_push_request_errors_array(self.cluster, api_key, len(errors), array)
            return None
        if command == "tracked_requests":
            return self._tracked_requests(clear=bool(args[0]))
        function = self.functions[command]
        fixed = function.argtypes[1:]
        converted = [a.encode() if isinstance(a, str) else a for a in args]
        variadic = [_c.c_int(a) for a in converted[len(fixed):]]
        result = function(self.cluster, *converted[: len(fixed)], *variadic)
        if function.restype is _ERR and result != 0:
            raise MockKafkaError(self.lib.rd_kafka_err2name(result).decode())
        return None

    def _tracked_requests(self, *, clear: bool) -> list[list[int]]:
        count = _c.c_size_t(0)
        requests = self.lib.rd_kafka_mock_get_requests(self.cluster, _c.byref(count))
        rows = [[self.lib.rd_kafka_mock_request_id(requests[i]), self.lib.rd_kafka_mock_request_api_key(requests[i]),
                 self.lib.rd_kafka_mock_request_timestamp(requests[i])] for i in range(count.value)]
        if requests:
            self.lib.rd_kafka_mock_request_destroy_array(requests, count.value)
        if clear:
            self.lib.rd_kafka_mock_clear_requests(self.cluster)
        return rows


def _exit(log_dir: str | None) -> None:
    """Exit at once (no clean shutdown needed: the kernel closes the listeners); nobody will read the log."""
    if log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)
    os._exit(0)


def _exit_when_orphaned(parent_pid: int, log_dir: str | None) -> None:
    """Exit as soon as the parent is gone (re-parented), even if it was SIGKILLed."""
    while os.getppid() == parent_pid:
        time.sleep(0.2)
    _exit(log_dir)


def _serve(brokers: int, parent_pid: int, log_dir: str | None) -> None:
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid, log_dir), daemon=True).start()
    helper = _Helper(brokers)
    print(helper.bootstrap_servers(), flush=True)
    for line in sys.stdin:  # EOF: the parent closed our stdin or died
        command, *args = json.loads(line)
        try:
            answer = {"result": helper.run(command, args)}
        except (MockKafkaError, KeyError, TypeError, ValueError, ctypes.ArgumentError) as error:
            answer = {"error": f"{type(error).__name__}: {error}" if not isinstance(error, MockKafkaError) else str(error)}
        print(json.dumps(answer), flush=True)
    _exit(log_dir)  # stdin closed: the parent is gone or done with us


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="librdkafka mock Kafka cluster on 127.0.0.1 (test helper)")
    parser.add_argument("--brokers", type=int, default=3)
    parser.add_argument("--parent-pid", type=int, default=os.getppid())
    parser.add_argument("--log-dir", help="the directory of our stderr log, removed when we exit by ourselves")
    options = parser.parse_args()
    _serve(options.brokers, options.parent_pid, options.log_dir)
