# The two commands a newcomer needs: `make run` and `make test`.
SWIFT ?= swift
BUILD_FLAGS ?=

.PHONY: deps test-deps build build-tests test unit check-links check-contract check-deploy deploy-check-unit container-check api-fuzz fuzz-build fuzz-build-background test-times-reset unit-notice fuzz soak mutants run cluster cluster-stop bench bench-redis instructions clean

# What building and running need (make run, make build); test-deps adds what the tests need, and
# the deploy linters from PyPI in .tools/venv (never the system's Python: Debian's is externally
# managed, PEP 668).
deps:
	@scripts/install-deps run

test-deps:
	@scripts/install-deps test

build: deps
	$(SWIFT) build $(BUILD_FLAGS)

build-tests: test-deps
	scripts/test-run build $(SWIFT) build --build-tests $(BUILD_FLAGS)

# Builds once, then runs every test against a throwaway redis-server on a free loopback port;
# the light ones twice, the second time with sharded pub/sub (SPUBLISH/SSUBSCRIBE) on that server.
# Bounded: a run that hangs fails after 15 minutes instead of holding CI.
# The fuzzers' own build (AddressSanitizer, .build-fuzz) and their bounded runs start first and go
# on beside everything else at idle CPU priority (scripts/background): the suites mostly wait on
# leases and timeouts and leave a core free much of the time. The run waits for them before the
# cluster. Each step's time is printed at the end (scripts/test-times).
# The deployment files are checked first. The end-to-end test (3 nodes behind HAProxy, 300
# clients) and the benchmark runs load the whole machine, so they run after the others, alone:
# beside them, the timing of the other tests (leases of 3 s) would not hold on 2 cores.
HEAVY_TESTS = GatewayFaultTests
# A test run that fails prints its failures again at its end (scripts/test-run).
# Then the browser client's logic under Node's test runner, the browser end-to-end test in headless
# Chromium (two nodes, two pages and the dashboard; alone, as its bounds are in seconds), the soak
# (60 s), a small sync storm (the Swift SDK catching up on 30 conversations, 30 more groups
# followed: it fails on a refusal, an error frame or a message missing or out of order),
# schemathesis on the REST routes, and the wait for the libFuzzer runs begun beside the build.
# Last, against a throwaway 6-node Redis Cluster (scripts/with-redis-cluster): the cluster router's
# tests, then the engine and gateway suites again with the cluster as their Redis (one test at a
# time: on 2 cores, six servers beside the parallel suite starve the 3 s leases; the model test
# takes 500 steps there, 2000 on one server). Then, each on a fresh cluster (each kills a primary):
# the sharded pub/sub subscriber through slot moves and failovers; three gateway processes
# under load through a CLUSTER FAILOVER and a kill -9 of a primary, then a node cut off from every
# cluster node by iptables (as root).
# Both searches run with fixed seeds (printed), so that every run tries the same inputs: a red
# `make test` means the code changed, not that a random search got lucky. Random, longer
# campaigns are `make fuzz` and `make api-fuzz`.
TEST_SEED = 20261124
# The light suites run at most 4 tests at a time (swift-testing's limit): all of them at once
# start some 30 nodes and processes together on 2 cores, where a 3 s lease renewed late lapses
# and a reaper pass runs seconds behind. The run takes no longer (the model test is the longest).
LIGHT_WIDTH = SWT_EXPERIMENTAL_MAXIMUM_PARALLELIZATION_WIDTH=4
# The second pass, with sharded pub/sub on the one server, runs the subscriber's own suite and the
# fan-out across two nodes: the engine and gateway suites run with sharded pub/sub on the cluster
# (step "on-cluster"), and the SDK's suites do not see which pub/sub the nodes use.
SHARDED_TESTS = \.(WebSocketTests|RedisSubscriberTests)(/|$$)
test: test-times-reset check-links check-contract fuzz-build-background build-tests check-deploy
	scripts/with-redis sh -c '$(LIGHT_WIDTH) scripts/test-run light timeout --kill-after=10 900 $(SWIFT) test --skip-build $(BUILD_FLAGS) --skip "$(HEAVY_TESTS)" \
	  && $(LIGHT_WIDTH) PRESENCE_TEST_REDIS_PUBSUB=sharded scripts/test-run light-sharded timeout --kill-after=10 900 $(SWIFT) test --skip-build $(BUILD_FLAGS) \
	     --filter "$(SHARDED_TESTS)" --skip "$(HEAVY_TESTS)" \
	  && scripts/test-run heavy timeout --kill-after=10 900 $(SWIFT) test --skip-build --no-parallel $(BUILD_FLAGS) --filter "$(HEAVY_TESTS)" \
	  && scripts/test-run web timeout --kill-after=10 120 node --test Tests/Web/ \
	  && scripts/test-run browser timeout --kill-after=10 300 Tests/Browser/e2e.py \
	  && scripts/test-run browser-messaging timeout --kill-after=10 300 Tests/Browser/messaging.py \
	  && scripts/test-run soak timeout --kill-after=10 300 .build/debug/presence-bench soak --duration 60 --seed $(TEST_SEED) \
	  && scripts/test-run sync-storm timeout --kill-after=10 120 .build/debug/presence-bench sync-storm --conversations 30 --groups 30 --messages 5'
	API_FUZZ_SEED=$(TEST_SEED) scripts/test-run api-fuzz timeout --kill-after=10 300 scripts/api-fuzz
	scripts/background wait fuzz
	scripts/with-redis-cluster sh -c 'scripts/test-run cluster timeout --kill-after=10 300 $(SWIFT) test --skip-build $(BUILD_FLAGS) --filter ClusterRouterTests \
	  && PRESENCE_TEST_REDIS_URL="$$PRESENCE_TEST_REDIS_CLUSTER_URL" PRESENCE_MODEL_STEPS=500 scripts/test-run on-cluster \
	     timeout --kill-after=10 600 $(SWIFT) test --skip-build --no-parallel $(BUILD_FLAGS) --filter "^(PresenceEngineTests|PresenceGatewayTests)\."'
	scripts/with-redis-cluster scripts/test-run cluster-pubsub timeout --kill-after=10 300 $(SWIFT) test --skip-build $(BUILD_FLAGS) --filter ClusterSubscriberTests
	scripts/with-redis-cluster scripts/test-run cluster-faults timeout --kill-after=10 400 $(SWIFT) test --skip-build --no-parallel $(BUILD_FLAGS) --filter "ClusterGatewayTests|ClusterPartitionTests"
	scripts/with-redis-cluster scripts/test-run cluster-chaos timeout --kill-after=10 600 $(SWIFT) test --skip-build --no-parallel $(BUILD_FLAGS) --filter "ChaosTests/chaosOnCluster"
	PRESENCE_TEST_CLUSTER_CLOCK_OFFSET_MS=5000 scripts/with-redis-cluster scripts/test-run cluster-clocks timeout --kill-after=10 120 $(SWIFT) test --skip-build $(BUILD_FLAGS) --filter ClusterClockTests
	@scripts/test-times report

test-times-reset:
	@scripts/test-times reset

# The tests that need no Redis, no node and no network: parsers, codecs, configuration, the
# connection handler and mailbox on embedded channels, the clients' logic on a test clock, the
# fuzzers' regression inputs; then the browser client's logic under Node. Seconds after a build
# (no fuzzer build): the loop to run while changing code. `make test` runs them too, with the rest.
# Whole test targets: a suite that needs no server goes in one of these (Package.swift).
UNIT_TARGETS = ^(PresenceProtocolTests|RedisClientUnitTests|PresenceEngineUnitTests|PresenceGatewayUnitTests|PresenceClientUnitTests)\.
unit: unit-notice build-tests
	env -u PRESENCE_TEST_REDIS_URL -u PRESENCE_TEST_REDIS_CLUSTER_URL timeout --kill-after=10 120 $(SWIFT) test --skip-build $(BUILD_FLAGS) --filter '$(UNIT_TARGETS)'
	timeout --kill-after=10 120 node --test Tests/Web/

# Said before anything is installed or built, so that a first `make unit` is not taken for hung.
unit-notice:
	@[ -e .build/debug/presence-gatewayPackageTests.xctest ] || echo "make unit: nothing built yet: first it installs the test packages and builds everything (about 10 minutes on 2 cores), then the tests take seconds"

# schemathesis against openapi.yaml on a live node: no 5xx, every answer as documented. A short
# run with a random (printed) seed; API_FUZZ_EXAMPLES=500 for a long one, API_FUZZ_SEED to replay.
# (`make test` runs it with a fixed seed.)
api-fuzz: test-deps
	$(SWIFT) build --product presence-gateway $(BUILD_FLAGS)
	scripts/api-fuzz

# presence-fuzz under libFuzzer and AddressSanitizer, in a build folder of its own (RedisClient,
# PresenceProtocol and their dependencies built again: about 7 minutes alone on 2 cores).
FUZZ_BUILD = $(SWIFT) build --product presence-fuzz -Xswiftc -sanitize=fuzzer,address -Xswiftc -DFUZZING -Xswiftc -use-ld=lld --scratch-path .build-fuzz
fuzz-build: test-deps
	$(FUZZ_BUILD)

# `make test` builds the fuzzers and runs each target a fixed number of inputs from TEST_SEED
# beside everything else, at idle priority (scripts/background); each step's log is
# .build/test-fuzz-*.log. Bounded by the count of inputs; the timeouts only catch a hang, as idle
# priority may stretch a step's time.
fuzz-build-background: test-deps
	scripts/background start fuzz sh -c 'scripts/test-run fuzz-build $(FUZZ_BUILD) \
	  && scripts/test-run fuzz-resp timeout --kill-after=10 1800 scripts/fuzz --runs 30000 --seed $(TEST_SEED) resp \
	  && scripts/test-run fuzz-frames timeout --kill-after=10 1800 scripts/fuzz --runs 15000 --seed $(TEST_SEED) frames'

# Each fuzz target for FUZZ_SECONDS (default 600) from a random seed (printed; FUZZ_SEED to
# replay); see docs/testing.md, "Fuzzing and soak".
FUZZ_SECONDS ?= 600
fuzz: fuzz-build
	scripts/fuzz --seconds $(FUZZ_SECONDS) $(if $(FUZZ_SEED),--seed $(FUZZ_SEED))

# SOAK_SECONDS (default 600) of random churn over 2 nodes, then the leak checks
# (docs/testing.md, "Fuzzing and soak").
SOAK_SECONDS ?= 600
soak: test-deps
	$(SWIFT) build --product presence-gateway $(BUILD_FLAGS)
	$(SWIFT) build --product presence-bench $(BUILD_FLAGS)
	scripts/with-redis .build/debug/presence-bench soak --duration $(SOAK_SECONDS)

# Every relative link and #anchor in the tracked Markdown files must resolve (scripts/check-links).
check-links:
	scripts/check-links

# docs/API.md names every route of openapi.yaml, every frame type and close code of the protocol,
# and no other (scripts/check-contract).
check-contract:
	scripts/check-contract

# docker-compose.yml and deploy/: yamllint, hadolint, haproxy -c, promtool, kubernetes-validate and
# check-jsonschema (Compose schema), then what the files must agree on with each other and with
# the gateway (its settings, as `presence-gateway --print-config-schema` prints them, and the
# metric names in its sources). Its own unit tests first.
check-deploy: test-deps deploy-check-unit
	$(SWIFT) build --product presence-gateway $(BUILD_FLAGS)
	PATH="$(CURDIR)/.tools/venv/bin:$$PATH" scripts/check-deploy --gateway "$$($(SWIFT) build --show-bin-path $(BUILD_FLAGS))/presence-gateway"

# The unit tests of scripts/check-deploy's cross-checks (scripts/deploycheck/tests/): each module
# on small scratch trees, good and broken, with a fixture schema for the gateway. No linter, no
# build, no network; seconds.
deploy-check-unit: test-deps
	.tools/venv/bin/python3 -m unittest discover -s scripts/deploycheck/tests -t scripts

# deploy/Dockerfile's runtime image built with podman, run beside a Redis: /readyz, the health
# check, its uid, a clean stop on SIGTERM (scripts/check-container; as root). Not part of `make
# test`: the release build and a debootstrap'd base take some 15 minutes the first time.
container-check: deps
	@scripts/install-deps container
	scripts/check-container

# Each hand mutant of scripts/mutants (a guard taken away) against the tests that must catch it;
# prints the survivors and fails if there are any. Some 10 minutes: an incremental build a mutant.
mutants: build-tests
	scripts/with-redis scripts/mutants

# Starts a gateway node on 127.0.0.1:8080 (see README).
run: deps
	scripts/run

# Pipelined throughput of the Redis client beside redis-benchmark (numbers in BENCHMARKS.md).
bench-redis: deps
	$(SWIFT) build -c release --product redis-client-bench
	scripts/with-redis .build/release/redis-client-bench

# Three nodes behind HAProxy on loopback (see docs/deploying.md); `make cluster-stop` ends it.
cluster: test-deps
	$(SWIFT) build --product presence-gateway
	$(SWIFT) build --product presencectl
	scripts/cluster start

cluster-stop:
	scripts/cluster stop

# The scenarios of BENCHMARKS.md against release-built node processes (several minutes; JSON
# results in bench-results/), then the in-process engine and latency numbers. The largest idle
# run is 50,000 sessions or what the open-file hard limit allows; the reconnect storm is 2,000
# devices, what 2 cores hold (BENCHMARKS.md has the larger runs).
bench: deps
	$(SWIFT) build -c release --product presence-gateway
	$(SWIFT) build -c release --product presence-bench
	mkdir -p bench-results
	scripts/with-redis sh -c 'set -e; b=.build/release/presence-bench; r=bench-results; \
	  $$b idle --sessions 10000 --json $$r/idle-10k.json; \
	  n=$$(( $$(ulimit -Hn) - 1000 )); [ $$n -gt 50000 ] && n=50000; \
	  $$b idle --sessions $$n --json $$r/idle-max.json; \
	  $$b churn --rate 1000 --duration 20 --json $$r/churn.json; \
	  $$b storm --devices 10000 --json $$r/storm.json; \
	  $$b fanout --watchers 10000 --json $$r/fanout.json; \
	  $$b floor --connections 4000 --json $$r/floor.json; \
	  $$b death --sessions 5000 --lease 10 --json $$r/death.json; \
	  $$b cost --devices 10000 --idle-seconds 60 --json $$r/cost.json; \
	  $$b group-messages --threads 2 --json $$r/group-messages.json; \
	  $$b reconnect-storm --threads 2 --sessions 2000 --rate 100 --json $$r/reconnect-storm.json; \
	  $$b engine --devices 10000 --idle-seconds 60; \
	  $$b latency --rate 1000 --duration 20'

# The node's instructions per status change, per delivery and per message under callgrind
# (exact, where CPU time is noisy); valgrind 3.24 is unpacked into .tools/valgrind, Debian's
# vgdb talks to it.
instructions: deps
	scripts/fetch-valgrind
	$(SWIFT) build -c release --product presence-gateway
	$(SWIFT) build -c release --product presence-bench
	scripts/with-redis .build/release/presence-bench instructions

clean:
	rm -rf .build
