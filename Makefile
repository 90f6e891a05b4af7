SHELL := /bin/bash
GO ?= go
GOFMT ?= gofmt
# Pinned so lint results don't change under us; fetched via the module proxy.
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2

.PHONY: test vet lint bench run build redis-shell

# Tests get a real standalone Redis and a 3-node Redis Cluster from
# scripts/redis-env.sh (see SLUICE_TEST_REDIS_* there), and Prometheus,
# promtool and a headless Chromium from scripts/test-tools.sh (the limits
# page's, the dashboard's and the rules' tests). The unit tests that
# mostly wait (on TTLs, on Redis failing, on a manual clock's tasks) are
# t.Parallel: 8 of them at once, where their waits overlap (at 4, jobs's
# longest, TestKeyedQuotaMemoryBack, 70 s of TTLs, waited 13 s for a place:
# jobs and throttle took 148 s together; 117 s at 8, with eight more jobs
# tests beside the others; the 2 CPUs were 40% busy at 4). The two longest
# packages, jobs and throttle, are named first: go test builds and starts
# packages in the order given, and in ./...'s order the others held the
# two places first (the unit tests took 215 s from a fresh clone, 183 s
# with these first). Three packages run at once, not go test's default of
# one a CPU: jobs and throttle wait more than they compute, and with two
# places the small packages (config's 21 s among them) ran only after
# them (the unit tests 164 s after their build began, 128 s with -p 3).
# go vet and the
# lint run before them, not beside: on 2 CPUs their builds and the tests'
# race-instrumented builds slowed each other (2026-12-03: the unit tests
# with vet and the lint beside them took 352 s, about 306 s after them).
# The end-to-end package (./test) runs after the others, not beside them: it measures
# drain rates to the request, and unit tests sharing the CPUs would add
# their noise to its timings. Its tests spend their time waiting on slow
# drains, each on queues and keys of its own, so they run side by side
# (E2E_PARALLEL at once), but for the three that load the CPUs most,
# which run alone first: TestLimitsImport (100,000 overrides applied in
# each worker), TestKeyedQuota (200 requests a second) and
# TestShardedQueue (300 a second). It
# runs without -race: the code it tests runs in the worker and enqueue
# binaries (built without it), and the test process, which stamps the
# upstream's arrivals, must not stall while it measures. Both parts run
# even if one fails. 6 at once, not 8: at 8 the 2 CPUs are so busy that a
# worker or the test process stalls for 50-80 ms now and then, and the
# tests that count a drain's requests in any one second (TestGatesCombined,
# TestDrainAccuracy) saw 2 or 3 arrive together (2026-12-03: failed in 2
# of 3 runs at 8, passed in 2 of 2 at 6; the package took 213 s at 8 and
# 266-281 s at 6).
#
# E2E_IDLE names the end-to-end tests that spend their time waiting, not
# measuring: TestWorkerKilled waits one to two minutes, on each backend,
# for asynq's recoverer to give back a killed worker's tasks, and checks
# only that every task ran, once. They run beside the unit tests, from
# the start, where their waits cost no place among the timed tests (in
# the package's run they took 2 of its 6 places for 2 minutes: some 40 s
# of make test's time); their output follows the package's.
E2E_PARALLEL ?= 6
E2E_IDLE ?= ^TestWorkerKilled$$
test: vet lint
	scripts/test-tools.sh
	scripts/redis-env.sh bash -c '\
		idle_log=$$(mktemp); \
		$(GO) test -count=1 -timeout 15m -run "$(E2E_IDLE)" ./test >$$idle_log 2>&1 & idle_pid=$$!; \
		$(GO) test -p 3 -race -count=1 -timeout 15m -parallel 8 ./jobs ./throttle $$($(GO) list ./... | grep -Ev "/sluice/(test|jobs|throttle)$$"); unit=$$?; \
		$(GO) test -count=1 -timeout 15m -parallel $(E2E_PARALLEL) -skip "$(E2E_IDLE)" ./test; e2e=$$?; \
		wait $$idle_pid; idle=$$?; echo "--- the waiting end-to-end tests ($(E2E_IDLE)):"; cat $$idle_log; rm -f $$idle_log; \
		exit $$((unit || e2e || idle))'

vet:
	$(GO) vet ./...

lint:
	@files=$$($(GOFMT) -l .); if [ -n "$$files" ]; then \
		echo "gofmt needed on:"; echo "$$files"; exit 1; fi
	$(GO) run $(STATICCHECK) ./...

bench:
	scripts/redis-env.sh $(GO) run ./cmd/bench

# The demo: a worker on config.yaml with a burst of demo tasks in every
# queue, showing each queue drain at its configured rate. It uses the Redis
# at redis.addr if one answers there, or else serves an embedded one.
run:
	@addr=$${SLUICE_REDIS_ADDR:-127.0.0.1:6379}; \
	if (exec 3<>"/dev/tcp/$${addr%:*}/$${addr##*:}") 2>/dev/null; then embedded=; \
	else embedded=--embedded-redis; fi; \
	$(GO) run ./cmd/worker --config config.yaml $$embedded --demo 100

build:
	$(GO) build -buildvcs=auto -o bin/ ./cmd/...

# A shell with the test servers up; they go away when the shell exits.
redis-shell:
	scripts/redis-env.sh bash
