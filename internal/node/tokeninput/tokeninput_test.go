package tokeninput

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/secret"
)

func newToken(t *testing.T) string {
	t.Helper()
	plain, _ := secret.Mint()
	return secret.Format(scheme, ids.New(ids.JoinToken, time.Unix(1_700_000_000, 0)), plain)
}

// noEcho fails when err shows any of the input.
func noEcho(t *testing.T, err error, input string) {
	t.Helper()
	in := strings.TrimSpace(input)
	if in == "" || err == nil {
		return
	}
	msg := err.Error()
	// Any 8-character piece of the input would be a leak.
	for i := 0; i+8 <= len(in); i++ {
		piece := in[i : i+8]
		if strings.Contains(msg, piece) && !strings.Contains(shapeHelp, piece) &&
			!strings.Contains("an API key, not a join token", piece) {
			t.Fatalf("R11.2: the error echoes the input (%q): %s", piece, msg)
		}
	}
}

func TestParse(t *testing.T) {
	tok := newToken(t)
	id, plain, _ := strings.Cut(strings.TrimPrefix(tok, "bcjt_"), ".")
	tests := []struct {
		name, in string
		ok       bool
		want     string // error substring
	}{
		{name: "token", in: tok, ok: true},
		{name: "trailing newline", in: tok + "\n", ok: true},
		{name: "surrounding white space", in: "  \t" + tok + "\r\n", ok: true},
		{name: "empty", in: " \n", want: "empty"},
		{name: "API key", in: "bck_key_01k5w." + plain, want: "an API key, not a join token"},
		{name: "no scheme", in: id + "." + plain, want: "not a join token"},
		{name: "other id prefix", in: "bcjt_key_01k5w." + plain, want: "not a join token"},
		{name: "upper-case id", in: "bcjt_" + strings.ToUpper(id) + "." + plain, want: "not a join token"},
		{name: "short secret", in: tok[:len(tok)-1], want: "not a join token"},
		{name: "long secret", in: tok + "A", want: "not a join token"},
		{name: "bad secret characters", in: "bcjt_" + id + "." + strings.Repeat("+", 43), want: "not a join token"},
		{name: "two tokens", in: tok + "\n" + tok, want: "not a join token"},
		{name: "space inside", in: "bcjt_" + id + ". " + plain[1:], want: "not a join token"},
		{name: "no secret", in: "bcjt_" + id, want: "not a join token"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(tt.in)
			if tt.ok {
				if err != nil || got != tok {
					t.Fatalf("R11.2: Parse: %q %v", got, err)
				}
				return
			}
			if errs.CodeOf(err) != errs.InvalidArgument || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("R11.2: got %v, want INVALID_ARGUMENT %q", err, tt.want)
			}
			noEcho(t, err, tt.in)
		})
	}
}

func TestFromStdin(t *testing.T) {
	tok := newToken(t)
	tests := []struct {
		name, in string
		ok       bool
		want     string
	}{
		{name: "token", in: tok + "\n", ok: true},
		{name: "token padded to 4 KiB", in: tok + strings.Repeat("\n", MaxSize-len(tok)), ok: true},
		{name: "over 4 KiB", in: tok + strings.Repeat("\n", MaxSize-len(tok)+1), want: "more than 4096 bytes"},
		{name: "nothing", in: "", want: "no join token on standard input"},
		{name: "not a token", in: "hunter2-secret-password\n", want: "not a join token"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := FromStdin(strings.NewReader(tt.in))
			if tt.ok {
				if err != nil || got != tok {
					t.Fatalf("R11.2: %q %v", got, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("R11.2: got %v, want %q", err, tt.want)
			}
			noEcho(t, err, tt.in)
		})
	}
}

func TestFromEnv(t *testing.T) {
	tok := newToken(t)
	env := func(v string, set bool) func(string) (string, bool) {
		return func(k string) (string, bool) {
			if k != EnvVar {
				t.Fatalf("looked up %s", k)
			}
			return v, set
		}
	}
	tests := []struct {
		name    string
		lookup  func(string) (string, bool)
		wantTok string
		wantOK  bool
		wantErr string
	}{
		{name: "set", lookup: env(tok, true), wantTok: tok, wantOK: true},
		{name: "unset", lookup: env("", false)},
		{name: "empty", lookup: env(" ", true)},
		{name: "not a token", lookup: env("bcjt_nope", true), wantOK: true, wantErr: "BCD_JOIN_TOKEN: not a join token"},
		{name: "huge", lookup: env(strings.Repeat("a", MaxSize+1), true), wantOK: true, wantErr: "more than"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok, err := FromEnv(tt.lookup)
			if got != tt.wantTok || ok != tt.wantOK {
				t.Errorf("R11.2: got %q %v", got, ok)
			}
			if tt.wantErr == "" && err != nil || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Fatalf("R11.2: err %v, want %q", err, tt.wantErr)
			}
		})
	}
	t.Run("os environment", func(t *testing.T) {
		t.Setenv(EnvVar, tok)
		if got, ok, err := FromEnv(nil); got != tok || !ok || err != nil {
			t.Fatalf("R11.2: %q %v %v", got, ok, err)
		}
	})
}

func TestFromFile(t *testing.T) {
	tok := newToken(t)
	type setup func(t *testing.T, dir string) string
	file := func(content string, mode os.FileMode) setup {
		return func(t *testing.T, dir string) string {
			p := filepath.Join(dir, "join-token")
			writeMode(t, p, content, mode)
			return p
		}
	}
	tests := []struct {
		name  string
		setup setup
		want  []string // error substrings; none means success
	}{
		{name: "0600", setup: file(tok+"\n", 0o600)},
		{name: "0400", setup: file(tok, 0o400)},
		{name: "0644", setup: file(tok, 0o644), want: []string{"mode 0644", "0600 or 0400", "chmod 600", "defaultMode: 0400"}},
		{name: "0640", setup: file(tok, 0o640), want: []string{"mode 0640"}},
		{name: "0700", setup: file(tok, 0o700), want: []string{"mode 0700"}},
		{name: "0000", setup: file(tok, 0), want: []string{"mode 0000"}},
		{name: "0660", setup: file(tok, 0o660), want: []string{"mode 0660"}},
		{name: "too large", setup: file(tok+strings.Repeat(" ", MaxSize), 0o600), want: []string{"a token file holds at most 4096"}},
		{name: "not a token", setup: file("password123\n", 0o600), want: []string{"not a join token"}},
		{name: "missing", setup: func(t *testing.T, dir string) string { return filepath.Join(dir, "nope") }, want: []string{"no file at"}},
		{name: "directory", setup: func(t *testing.T, dir string) string { return dir }, want: []string{"not a regular file"}},
		{name: "fifo", setup: func(t *testing.T, dir string) string {
			p := filepath.Join(dir, "fifo")
			if err := syscall.Mkfifo(p, 0o600); err != nil {
				t.Skip("mkfifo:", err)
			}
			return p
		}, want: []string{"not a regular file"}},
		{name: "symlink out of its directory", setup: func(t *testing.T, dir string) string {
			other := filepath.Join(t.TempDir(), "elsewhere")
			writeMode(t, other, tok, 0o600)
			p := filepath.Join(dir, "join-token")
			symlink(t, other, p)
			return p
		}, want: []string{"symbolic link out of its directory"}},
		{name: "dangling symlink", setup: func(t *testing.T, dir string) string {
			p := filepath.Join(dir, "join-token")
			symlink(t, "nope", p)
			return p
		}, want: []string{"does not resolve"}},
		{name: "Kubernetes Secret layout", setup: func(t *testing.T, dir string) string {
			// token -> ..data/token, ..data -> ..2026_03_01_12_00_00.1
			ts := filepath.Join(dir, "..2026_03_01_12_00_00.1")
			if err := os.Mkdir(ts, 0o755); err != nil {
				t.Fatal(err)
			}
			writeMode(t, filepath.Join(ts, "token"), tok, 0o400)
			symlink(t, "..2026_03_01_12_00_00.1", filepath.Join(dir, "..data"))
			symlink(t, "..data/token", filepath.Join(dir, "token"))
			return filepath.Join(dir, "token")
		}},
		{name: "Kubernetes Secret without defaultMode", setup: func(t *testing.T, dir string) string {
			ts := filepath.Join(dir, "..2026_03_01_12_00_00.1")
			if err := os.Mkdir(ts, 0o755); err != nil {
				t.Fatal(err)
			}
			writeMode(t, filepath.Join(ts, "token"), tok, 0o644)
			symlink(t, "..2026_03_01_12_00_00.1", filepath.Join(dir, "..data"))
			symlink(t, "..data/token", filepath.Join(dir, "token"))
			return filepath.Join(dir, "token")
		}, want: []string{"defaultMode: 0400"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := tt.setup(t, t.TempDir())
			got, cleanup, err := FromFile(p)
			if len(tt.want) == 0 {
				if err != nil || got != tok {
					t.Fatalf("R11.2: %q %v", got, err)
				}
				// cleanup deletes the named path, then has nothing to do.
				if w, err := cleanup(); w != "" || err != nil {
					t.Fatalf("R11.2: cleanup: %q %v", w, err)
				}
				if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
					t.Fatalf("R11.2: the token file is still there: %v", err)
				}
				if w, err := cleanup(); w != "" || err != nil {
					t.Fatalf("second cleanup: %q %v", w, err)
				}
				return
			}
			if err == nil {
				t.Fatalf("R11.2: no error, want %q", tt.want)
			}
			if cleanup != nil {
				t.Error("cleanup returned with an error")
			}
			if errs.CodeOf(err) != errs.InvalidArgument {
				t.Errorf("code %s", errs.CodeOf(err))
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("R11.2: %q lacks %q", err, w)
				}
			}
			noEcho(t, err, tok)
			if _, statErr := os.Lstat(p); statErr != nil && !errors.Is(statErr, fs.ErrNotExist) {
				t.Error(statErr)
			}
		})
	}
}

// R11.2: only the owner's file is taken.
func TestFromFileOwner(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to give the file to another user")
	}
	p := filepath.Join(t.TempDir(), "join-token")
	writeMode(t, p, newToken(t), 0o600)
	if err := os.Chown(p, 12345, 12345); err != nil {
		t.Fatal(err)
	}
	_, _, err := FromFile(p)
	if err == nil || !strings.Contains(err.Error(), "owned by uid 12345, not by uid 0") {
		t.Fatalf("R11.2: %v", err)
	}
}

// R11.2: a read-only mount that cannot be deleted is a warning.
func TestRemove(t *testing.T) {
	pe := func(e error) func(string) error {
		return func(p string) error { return &fs.PathError{Op: "remove", Path: p, Err: e} }
	}
	tests := []struct {
		name        string
		rm          func(string) error
		wantWarning string
		wantErr     bool
	}{
		{name: "deleted", rm: func(string) error { return nil }},
		{name: "already gone", rm: pe(syscall.ENOENT)},
		{name: "read-only Secret mount", rm: pe(syscall.EROFS), wantWarning: "read-only file system"},
		{name: "subPath bind mount", rm: pe(syscall.EBUSY), wantWarning: "could not delete the token file /t/join-token"},
		{name: "permission", rm: pe(syscall.EACCES), wantWarning: "permission denied"},
		{name: "not permitted", rm: pe(syscall.EPERM), wantWarning: "delete it, or the Secret that provides it, yourself"},
		{name: "I/O error", rm: pe(syscall.EIO), wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w, err := remove("/t/join-token", tt.rm)
			if (err != nil) != tt.wantErr {
				t.Fatalf("R11.2: err %v", err)
			}
			if tt.wantWarning == "" && w != "" || !strings.Contains(w, tt.wantWarning) {
				t.Fatalf("R11.2: warning %q, want %q", w, tt.wantWarning)
			}
		})
	}
}

func writeMode(t *testing.T, p, content string, mode os.FileMode) {
	t.Helper()
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil {
		t.Fatal(err)
	}
}

func symlink(t *testing.T, target, p string) {
	t.Helper()
	if err := os.Symlink(target, p); err != nil {
		t.Fatal(err)
	}
}
