package jobs

import (
	"context"
	"sync"
	"time"

	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/throttle"
)

// takeSlots takes the task's concurrency slots (its queue's and its
// type's), waiting up to HoldMax for them. It returns the function that
// gives them back, or nil and how soon to try again.
func (s *Scheduler) takeSlots(ctx context.Context, gs *gateSet, queue string, t *asynq.Task) (release func(), retryIn time.Duration, err error) {
	sems := gs.semaphoresOf(queue, t.Type())
	if len(sems) == 0 {
		return func() {}, 0, nil
	}
	id, _ := asynq.GetTaskID(ctx)
	holder := s.worker + ":" + id
	deadline := s.clock.Now().Add(gs.cfg.Worker.HoldMax)
	var taken []slot
	giveBack := func() {
		for _, sl := range taken {
			if err := sl.sem.Release(context.WithoutCancel(ctx), sl.key, holder); err != nil {
				s.log.Warn("cannot release a concurrency slot; its lease will end", "slot", sl.key, "err", err)
			}
		}
	}
	for _, sl := range sems {
		for {
			st, err := sl.sem.Acquire(ctx, sl.key, holder)
			if err != nil {
				// No Redis: run rather than hold the slot forever; the
				// rate gates still apply.
				s.log.Warn("concurrency limit unavailable", "slot", sl.key, "err", err)
				break
			}
			if st.Held {
				taken = append(taken, sl)
				break
			}
			if s.clock.Now().After(deadline) || ctx.Err() != nil {
				giveBack()
				return nil, min(max(st.Free, 50*time.Millisecond), time.Second), nil
			}
			<-s.clock.After(50 * time.Millisecond)
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { s.renew(ctx, taken, holder, stop) })
	return func() {
		close(stop)
		wg.Wait()
		giveBack()
	}, 0, nil
}

type slot struct {
	sem *throttle.Semaphore
	key string
}

func (s *Scheduler) renew(ctx context.Context, taken []slot, holder string, stop <-chan struct{}) {
	tick := time.NewTicker(slotLease / 3)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
			for _, sl := range taken {
				if _, err := sl.sem.Renew(context.WithoutCancel(ctx), sl.key, holder); err != nil {
					s.log.Warn("cannot renew a concurrency lease", "slot", sl.key, "err", err)
				}
			}
		}
	}
}
