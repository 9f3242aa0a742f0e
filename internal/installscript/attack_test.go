package installscript

import (
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// The attack review of the install script (R15, R11.5): what someone who can
// plant a name on the machine, or answer on the network, can make it do.

// victimFile writes want (mode 0600) to a file outside the script's root for
// a planted symlink to point at, and returns a check that it is exactly as
// written.
func victimFile(t *testing.T, name, want string) (string, func()) {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(want), 0o600); err != nil {
		t.Fatal(err)
	}
	return p, func() {
		t.Helper()
		if got := readFile(t, p); got != want {
			t.Errorf("%s was written through: %q", p, got)
		}
		if m := mode(t, p); m != 0o600 {
			t.Errorf("%s: mode %o, want 0600 (chmod through a symlink)", p, m)
		}
	}
}

// plant makes root/rel a symbolic link to target.
func plant(t *testing.T, root, rel, target string) string {
	t.Helper()
	p := filepath.Join(root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, p); err != nil {
		t.Fatal(err)
	}
	return p
}

// R15, R11.5: every target the script writes, file or directory (config.toml,
// join-encryption.jwk, bcd.service, the binary, /etc/bcd, the bin, unit and
// data directories), is refused when it is a symbolic link, before anything
// is downloaded: the script says which and exits 1, what the link points to
// is untouched, the link stays, and nothing else appears. A target file that
// is a directory (mv would move into it) and a target directory that is a
// file are refused too.
func TestInstallScriptRefusesSymlinkedTargetsR15(t *testing.T) {
	cases := []struct {
		name    string
		rel     string // under BCD_ROOT
		dir     bool   // the link points to a directory
		dangle  bool   // the link points to nothing
		upgrade bool   // no token: the upgrade path
	}{
		{name: "config.toml", rel: "etc/bcd/config.toml"},
		{name: "config.toml on upgrade", rel: "etc/bcd/config.toml", upgrade: true},
		{name: "join-encryption.jwk", rel: "etc/bcd/join-encryption.jwk"},
		{name: "bcd.service", rel: "etc/systemd/system/bcd.service"},
		{name: "the binary", rel: "usr/local/bin/bcd"},
		{name: "/etc/bcd", rel: "etc/bcd", dir: true},
		{name: "/etc/bcd dangling", rel: "etc/bcd", dangle: true},
		{name: "the bin directory", rel: "usr/local/bin", dir: true},
		{name: "the unit directory", rel: "etc/systemd/system", dir: true},
		{name: "the data directory", rel: "var/lib/bcd", dir: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d, _, p := setup(t)
			r := newRun(t, p)
			var target string
			check := func() {}
			switch {
			case c.dir:
				target = t.TempDir()
				check = func() {
					if f := files(t, target); len(f) != 0 {
						t.Errorf("written through the linked directory: %v", f)
					}
				}
			case c.dangle:
				target = filepath.Join(t.TempDir(), "nothing")
				check = func() {
					if _, err := os.Lstat(target); !os.IsNotExist(err) {
						t.Errorf("created %s through the dangling link: %v", target, err)
					}
				}
			default:
				// A config of this site: followed, it would make the
				// script upgrade.
				target, check = victimFile(t, filepath.Base(c.rel), "site = \""+p.Site+"\"\n")
			}
			link := plant(t, r.root, c.rel, target)
			before := files(t, r.root)

			var res runResult
			if c.upgrade {
				res = r.run("", false)
			} else {
				res = r.run(newToken(t)+"\n", true)
			}
			want := "install-bcd: refusing " + link + ": it is a symbolic link, and this script never writes through one; nothing was installed"
			if res.code != 1 || !strings.Contains(res.stderr, want) {
				t.Fatalf("exit %d, output %q; want exit 1 and %q", res.code, res.stderr, want)
			}
			check()
			if got, err := os.Readlink(link); err != nil || got != target {
				t.Errorf("the link was replaced: %q, %v", got, err)
			}
			if after := files(t, r.root); !slices.Equal(after, before) {
				t.Errorf("files under the root went from %v to %v", before, after)
			}
			if f := files(t, r.log); len(f) != 0 {
				t.Errorf("bcd ran: %v", f)
			}
			if len(d.asked) != 0 {
				t.Errorf("downloaded before refusing: %v", d.asked)
			}
		})
	}

	// Not a symbolic link, but not what the script would replace either.
	for _, c := range []struct{ name, rel, mk, want string }{
		{"config.toml a directory", "etc/bcd/config.toml", "dir", "it is not a regular file"},
		{"the binary a directory", "usr/local/bin/bcd", "dir", "it is not a regular file"},
		{"/etc/bcd a file", "etc/bcd", "file", "it is not a directory"},
	} {
		t.Run(c.name, func(t *testing.T) {
			d, _, p := setup(t)
			r := newRun(t, p)
			at := filepath.Join(r.root, c.rel)
			if c.mk == "dir" {
				os.MkdirAll(at, 0o755)
			} else {
				os.MkdirAll(filepath.Dir(at), 0o755)
				os.WriteFile(at, []byte("x\n"), 0o644)
			}
			before := files(t, r.root)
			res := r.run(newToken(t)+"\n", true)
			want := "install-bcd: refusing " + at + ": " + c.want + "; nothing was installed"
			if res.code != 1 || !strings.Contains(res.stderr, want) {
				t.Fatalf("exit %d, output %q; want exit 1 and %q", res.code, res.stderr, want)
			}
			if after := files(t, r.root); !slices.Equal(after, before) {
				t.Errorf("files under the root went from %v to %v", before, after)
			}
			if len(d.asked) != 0 {
				t.Errorf("downloaded before refusing: %v", d.asked)
			}
		})
	}
}

// plantingServer serves the builds like downloads, and runs plant once,
// before it answers the first build request.
type plantingServer struct {
	*downloads
	plant func()
	done  bool
}

func (s *plantingServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	first := !s.done
	s.done = true
	s.mu.Unlock()
	if first {
		s.plant()
	}
	s.downloads.ServeHTTP(w, r)
}

// R15, R11.5: the names the script once staged its files under are planted
// as symbolic links to files outside the root: <file>.install-bcd.tmp beside
// config.toml, join-encryption.jwk and bcd.service before the run, and
// .bcd.install-bcd.<the script's pid> beside the binary while the script
// downloads (the pid is known then). The script stages in directories of
// its own (mktemp) instead, so it installs as usual, and every planted
// link's target keeps its content and mode 0600.
func TestInstallScriptIgnoresPlantedStagingNamesR15(t *testing.T) {
	d := &downloads{files: map[string][]byte{}}
	ps := &plantingServer{downloads: d}
	srv := httptest.NewServer(ps)
	t.Cleanup(srv.Close)
	p := validParams(t)
	p.allowHTTP = true
	p.BaseURL = srv.URL
	p.BasePath = "/api/compute"
	bin := fakeBCD("v1")
	for _, a := range Arches {
		d.files["/api/compute/downloads/bcd/0.1.0/linux-"+a] = bin
	}
	p.SHA256 = map[string]string{"amd64": sum(bin), "arm64": sum(bin)}

	r := newRun(t, p)
	var checks []func()
	for _, rel := range []string{"etc/bcd/config.toml.install-bcd.tmp", "etc/bcd/join-encryption.jwk.install-bcd.tmp", "etc/systemd/system/bcd.service.install-bcd.tmp"} {
		v, check := victimFile(t, filepath.Base(rel), "victim\n")
		plant(t, r.root, rel, v)
		checks = append(checks, check)
	}
	pids := make(chan int, 1)
	r.onStart = func(pid int) { pids <- pid }
	ps.plant = func() {
		// The script is downloading, so it has started: its pid is sent.
		pid := <-pids
		v, check := victimFile(t, "bcd", "victim\n")
		plant(t, r.root, "usr/local/bin/.bcd.install-bcd."+strconv.Itoa(pid), v)
		checks = append(checks, check)
	}

	res := r.run(newToken(t)+"\n", true)
	if res.code != 0 {
		t.Fatalf("exit %d: %s", res.code, res.stderr)
	}
	if len(checks) != 4 {
		t.Fatalf("planted %d links, want 4 (was the binary downloaded?)", len(checks))
	}
	for _, check := range checks {
		check()
	}
	if got := readFile(t, filepath.Join(r.root, "usr/local/bin/bcd")); got != string(bin) {
		t.Fatalf("binary %q", got)
	}
	for _, rel := range []string{"etc/bcd/config.toml", "etc/bcd/join-encryption.jwk", "etc/systemd/system/bcd.service", "usr/local/bin/bcd"} {
		if st, err := os.Lstat(filepath.Join(r.root, rel)); err != nil || !st.Mode().IsRegular() {
			t.Errorf("%s is not a regular file the script wrote (%v)", rel, err)
		}
	}
	// Only the planted links and what the script installs: its staging
	// directories are gone.
	for _, f := range files(t, r.root) {
		if strings.Contains(f, ".install-bcd.") && !strings.HasSuffix(f, ".tmp") && !strings.Contains(f, ".bcd.install-bcd.") {
			t.Errorf("left behind %s", f)
		}
	}
}
