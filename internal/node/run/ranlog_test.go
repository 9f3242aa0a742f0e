package run

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/node/servertime"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// R12.3: the ids of the commands bcd ran are on disk before they run, and
// survive a restart; a duplicate while running is not answered twice;
// ids are pruned once their command expired (plus a grace).
func TestRanLog(t *testing.T) {
	dir := t.TempDir()
	c := clock.NewFake(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	l := newRanLog(dir, c)
	exp := c.Now().Add(10 * time.Minute)
	if st, err := l.begin("cmd_1", exp); err != nil || st != ranFresh {
		t.Fatalf("first begin: %v %v", st, err)
	}
	// Recorded before the run: on disk, owner-only.
	fi, err := os.Stat(filepath.Join(dir, RanFile))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("%s: %v %v", RanFile, fi, err)
	}
	if st, _ := l.begin("cmd_1", exp); st != ranRunning {
		t.Errorf("while running: %v, want running", st)
	}
	l.end("cmd_1")
	if st, _ := l.begin("cmd_1", exp); st != ranBefore {
		t.Errorf("after its run: %v, want ran before", st)
	}
	// A restart: a new log over the same directory, the run never ended
	// (the process died mid-command).
	if st, _ := l.begin("cmd_2", exp); st != ranFresh {
		t.Fatal("cmd_2")
	}
	restarted := newRanLog(dir, c)
	for _, id := range []string{"cmd_1", "cmd_2"} {
		if st, err := restarted.begin(id, exp); err != nil || st != ranBefore {
			t.Errorf("%s after a restart: %v %v, want ran before", id, st, err)
		}
	}
	// Pruned once expired plus the grace, at the next write.
	c.Advance(10*time.Minute + ranGrace + time.Millisecond)
	if st, _ := restarted.begin("cmd_3", c.Now().Add(time.Minute)); st != ranFresh {
		t.Fatal("cmd_3")
	}
	b, err := os.ReadFile(filepath.Join(dir, RanFile))
	if err != nil {
		t.Fatal(err)
	}
	var body ranFileBody
	if err := json.Unmarshal(b, &body); err != nil {
		t.Fatal(err)
	}
	if len(body.Commands) != 1 || body.Commands["cmd_3"] == 0 {
		t.Errorf("after expiry the file holds %v, want only cmd_3", body.Commands)
	}
}

// A damaged log, or one that cannot be written, runs nothing: forgetting
// it would let a captured command run again.
func TestRanLogFailsClosed(t *testing.T) {
	c := clock.NewFake(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	t.Run("damaged", func(t *testing.T) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, RanFile), []byte("{not json"), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := newRanLog(dir, c).begin("cmd_1", c.Now().Add(time.Minute))
		if err == nil || !strings.Contains(err.Error(), "is damaged; no command runs") {
			t.Fatalf("begin over a damaged log: %v", err)
		}
	})
	t.Run("not writable", func(t *testing.T) {
		if os.Geteuid() == 0 {
			// root writes anyway: make the path a directory instead.
			dir := t.TempDir()
			if err := os.Mkdir(filepath.Join(dir, RanFile), 0o700); err != nil {
				t.Fatal(err)
			}
			l := newRanLog(dir, c)
			l.loaded, l.ids = true, map[string]int64{}
			if _, err := l.begin("cmd_1", c.Now().Add(time.Minute)); err == nil {
				t.Fatal("recorded into a directory")
			}
			if st, err := l.begin("cmd_1", c.Now().Add(time.Minute)); err == nil || st == ranRunning {
				t.Fatalf("a failed record left the command running: %v %v", st, err)
			}
			return
		}
		dir := t.TempDir()
		if err := os.Chmod(dir, 0o500); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = os.Chmod(dir, 0o700) })
		if _, err := newRanLog(dir, c).begin("cmd_1", c.Now().Add(time.Minute)); err == nil {
			t.Fatal("recorded into a read-only directory")
		}
	})
	t.Run("full", func(t *testing.T) {
		l := newRanLog(t.TempDir(), c)
		l.loaded, l.ids = true, map[string]int64{}
		for i := range maxRan {
			l.ids["old_"+strconv.Itoa(i)] = c.Now().Add(time.Hour).UnixMilli()
		}
		if _, err := l.begin("cmd_1", c.Now().Add(time.Minute)); err == nil {
			t.Fatal("recorded past the bound")
		}
	})
}

// R21.4: bcd checks a command's expiry by the control plane's clock as it
// knows it, which may be up to servertime.MaxOffset off this machine's: a
// command id it ran is remembered that much longer by its own clock, so no
// offset makes a command it ran and forgot look unexpired.
func TestRanLogOutlivesTheLargestOffset(t *testing.T) {
	c := clock.NewFake(time.Unix(1_800_000_000, 0))
	l := newRanLog(t.TempDir(), c)
	expires := c.Now().Add(10 * time.Minute)
	if st, err := l.begin("cmd_1", expires); err != nil || st != ranFresh {
		t.Fatalf("begin: %v %v", st, err)
	}
	l.end("cmd_1")
	// A day and more later, by this machine's clock, another command is
	// recorded (which prunes what has expired).
	c.Advance(10*time.Minute + servertime.MaxOffset)
	if st, err := l.begin("cmd_2", c.Now().Add(10*time.Minute)); err != nil || st != ranFresh {
		t.Fatalf("begin cmd_2: %v %v", st, err)
	}
	if st, err := l.begin("cmd_1", expires); err != nil || st != ranBefore {
		t.Errorf("cmd_1 a day after its expiry: %v %v, want ranBefore", st, err)
	}
}
