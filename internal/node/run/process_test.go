package run_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/goroutines"
	"github.com/better-compute/better-compute/internal/node/run"
)

// bcd run, built as its command builds it (NewProcess), serves a session,
// runs a command and its diagnostics listener, and stops every goroutine
// it started (the session's loops, the renewer, the commands, the
// listener) before Run returns.
func TestProcessJoinsEverythingItStarted(t *testing.T) {
	eachOn(t, defaultOnly, func(t *testing.T, h *harness) {
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 1, 2)
		cfg := *m.cfg
		cfg.Diagnostics.Listen = "127.0.0.1:0"
		before := goroutines.Take()
		welcomed, diagAddr := make(chan string, 4), make(chan string, 1)
		p, err := run.NewProcess(run.ProcessConfig{BCD: &cfg, Log: quiet(),
			OnWelcome: func(id string) { welcomed <- id }, DiagReady: func(a string) { diagAddr <- a }})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- p.Run(ctx) }()
		select {
		case <-welcomed:
		case err := <-done:
			t.Fatalf("Run: %v", err)
		case <-time.After(30 * time.Second):
			t.Fatal("no Welcome")
		}
		res, err := http.Get("http://" + <-diagAddr + "/livez")
		if err != nil || res.StatusCode != http.StatusOK {
			t.Fatalf("diagnostics /livez: %v %v", res, err)
		}
		res.Body.Close()
		id := h.enqueue(t, m.nodeID)
		h.waitCommand(t, id)
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("Run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("Run did not return")
		}
		goroutines.Joined(t, before, "internal/node/")
	})
}
