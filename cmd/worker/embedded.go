package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/alicebob/miniredis/v2"
)

// startEmbeddedRedis serves an in-process Redis-compatible server
// (miniredis) on addr, for trying sluice with nothing but Go. It keeps
// nothing on disk. miniredis expires keys only when told time has passed,
// so a ticker tells it.
func startEmbeddedRedis(ctx context.Context, addr string, log *slog.Logger) (func(), error) {
	m := miniredis.NewMiniRedis()
	if err := m.StartAddr(addr); err != nil {
		return nil, err
	}
	fmt.Fprintf(os.Stderr, `
  ********************************************************************
  *  EMBEDDED REDIS on %-21s (miniredis, in this process)  *
  *  A TRY-OUT, NOT A STORE: every task is lost when the worker ends. *
  *  Point redis.addr at a real redis-server for anything else.      *
  ********************************************************************

`, addr)
	log.Warn("embedded redis is not durable", "addr", addr)
	done := make(chan struct{})
	go func() {
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		last := time.Now()
		for {
			select {
			case <-ctx.Done():
				return
			case <-done:
				return
			case now := <-tick.C:
				m.FastForward(now.Sub(last))
				last = now
			}
		}
	}()
	return func() {
		close(done)
		m.Close()
	}, nil
}
