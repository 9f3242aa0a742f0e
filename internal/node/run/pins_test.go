package run_test

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/better-compute/better-compute/internal/checks/enrolltest"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/node/config"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/run"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// syncBuffer is a log destination the test reads while the daemon writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// pinnedDaemon is a bcd joined through the fake gateway, its config.toml
// on disk, running its session with live pins persisted there.
type pinnedDaemon struct {
	srv      *enrolltest.Server
	path     string
	cfg      *bcdconfig.Config
	pins     *config.Pins
	logs     *syncBuffer
	welcomes chan string
}

func newPinnedDaemon(t *testing.T) *pinnedDaemon {
	t.Helper()
	s := enrolltest.New(t, enrolltest.Options{})
	root := t.TempDir()
	p := &pinnedDaemon{srv: s, cfg: s.Config(t, root), path: filepath.Join(root, "etc", "bcd", "config.toml"), logs: &syncBuffer{}, welcomes: make(chan string, 16)}
	if err := p.cfg.Write(p.path); err != nil {
		t.Fatal(err)
	}
	s.WriteKeyFile(t, filepath.Dir(p.path))
	j, err := enroll.New(enroll.Config{BCD: p.cfg, ConfigPath: p.path, Store: &identity.Store{Dir: p.cfg.DataDir}, Clock: clock.NewFake(s.Now), HTTPClient: s.HTTPClient})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := j.Join(context.Background(), enroll.Options{Token: s.Token}); err != nil {
		t.Fatal(err)
	}
	return p
}

// start runs the daemon until the test ends.
func (p *pinnedDaemon) start(t *testing.T) {
	t.Helper()
	log := slog.New(slog.NewTextHandler(p.logs, nil))
	p.pins = config.NewPins(p.path, p.cfg, log)
	d, err := run.New(run.Config{
		BCD: p.cfg, Store: &identity.Store{Dir: p.cfg.DataDir}, Clock: clock.NewFake(p.srv.Now.Add(time.Minute)), Log: log,
		HTTPClient: p.srv.HTTPClient, Pins: p.pins,
		OnWelcome: func(node string) { p.welcomes <- node },
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

func (p *pinnedDaemon) waitWelcome(t *testing.T) {
	t.Helper()
	select {
	case <-p.welcomes:
	case <-time.After(15 * time.Second):
		t.Fatalf("no Welcome; logs:\n%s", p.logs)
	}
}

func (p *pinnedDaemon) file(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(p.path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func newGeneration(t *testing.T) *ca.Bundle {
	t.Helper()
	b, err := ca.Generate(enrolltest.TrustDomain, time.Now().Add(-2*time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func mustPin(t *testing.T, pub any) string {
	t.Helper()
	p, err := pki.Pin(pub)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// R16.2: a Welcome's statements count only when a pinned key signed them:
// one a relay injects is ignored, one the pinned serving CA signed is
// learned and saved.
func TestWelcomeStatements(t *testing.T) {
	tests := []struct {
		name    string
		signer  func(pinned, evil *ca.Bundle) *ca.Bundle
		learned bool
	}{
		{name: "injected by a relay", signer: func(_, evil *ca.Bundle) *ca.Bundle { return evil }},
		{name: "signed by the pinned CA", signer: func(pinned, _ *ca.Bundle) *ca.Bundle { return pinned }, learned: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newPinnedDaemon(t)
			next := newGeneration(t)
			signer := tt.signer(p.srv.Bundle, newGeneration(t))
			p.srv.JoinService.SetKeyStatements([]string{
				enrolltest.Statement(t, pki.KindServingCA, pki.ActionTrust, signer.ServingCAKey, next.ServingCA.PublicKey),
			})
			before := p.file(t)
			p.start(t)
			p.waitWelcome(t)
			want := []string{p.srv.Pins.ServingCA}
			if tt.learned {
				want = append(want, mustPin(t, next.ServingCA.PublicKey))
			}
			if diff := cmp.Diff(want, p.pins.Set(pki.KindServingCA)); diff != "" {
				t.Errorf("live serving-CA set (-want +got):\n%s", diff)
			}
			saved, err := bcdconfig.Load(p.path)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(want, saved.ServingCAPins()); diff != "" {
				t.Errorf("saved serving-CA set (-want +got):\n%s", diff)
			}
			if !tt.learned && p.file(t) != before {
				t.Error("config.toml was written")
			}
		})
	}
}

// R16.2: the session of a bcd offline through a rotation of the serving
// CA fails on the gateway's chain; bcd asks Keys once, and with a statement
// of the pinned CA it dials again at once and is welcomed. With one of an
// unknown key, the session stays refused and config.toml unchanged.
func TestSessionAfterOfflineServingCARotation(t *testing.T) {
	for _, vouched := range []bool{true, false} {
		t.Run(map[bool]string{true: "vouched by the pinned CA", false: "vouched by an unknown key"}[vouched], func(t *testing.T) {
			p := newPinnedDaemon(t)
			next := newGeneration(t)
			signer := p.srv.Bundle
			if !vouched {
				signer = newGeneration(t)
			}
			p.srv.JoinService.SetKeyStatements([]string{
				enrolltest.Statement(t, pki.KindServingCA, pki.ActionTrust, signer.ServingCAKey, next.ServingCA.PublicKey),
				enrolltest.Statement(t, pki.KindServingCA, pki.ActionRetire, next.ServingCAKey, p.srv.Bundle.ServingCA.PublicKey),
			})
			p.srv.SetGatewayBundle(t, next)
			before := p.file(t)
			p.start(t)
			if vouched {
				p.waitWelcome(t)
				if diff := cmp.Diff([]string{mustPin(t, next.ServingCA.PublicKey)}, p.pins.Set(pki.KindServingCA)); diff != "" {
					t.Errorf("live serving-CA set (-want +got):\n%s", diff)
				}
				if n := p.srv.JoinService.KeysCalls(); n != 1 {
					t.Errorf("Keys calls = %d, want 1", n)
				}
				return
			}
			// The first attempt is over once the daemon says so and waits
			// to reconnect (on its fake clock, which does not move).
			poll.UntilDetail(t, 15*time.Second, p.logs.String, func() bool { return strings.Contains(p.logs.String(), "session ended") })
			select {
			case <-p.welcomes:
				t.Fatal("welcomed through a gateway on an unvouched CA")
			default:
			}
			if n := p.srv.JoinService.KeysCalls(); n != 1 {
				t.Errorf("Keys calls = %d, want 1", n)
			}
			if p.file(t) != before {
				t.Error("config.toml was written")
			}
			if !strings.Contains(p.logs.String(), "no rotated serving CA vouched for by a pinned key") {
				t.Errorf("logs do not say why:\n%s", p.logs)
			}
		})
	}
}
