package installscript

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/checks/tools"
)

// busyboxOnly returns a directory holding every BusyBox applet and nothing
// else: the PATH of a host that has only BusyBox.
func busyboxOnly(t *testing.T) (bin, busybox string) {
	t.Helper()
	busybox = tools.Need(t, "busybox", "a host whose only tools are BusyBox's")
	out, err := exec.Command(busybox, "--list").Output()
	if err != nil {
		t.Fatal(err)
	}
	bin = t.TempDir()
	for _, applet := range strings.Fields(string(out)) {
		if err := os.Symlink(busybox, filepath.Join(bin, applet)); err != nil {
			t.Fatal(err)
		}
	}
	return bin, busybox
}

// R11.5: on a host with only BusyBox (its sh, its wget, its sha256sum), and
// with a CA file embedded for the download, the script installs and joins:
// BusyBox wget takes no CA option, so the script says that only the
// SHA-256 vouches for the download instead of failing on the option.
func TestInstallScriptBusyBoxOnly(t *testing.T) {
	bin, busybox := busyboxOnly(t)
	_, _, p := setup(t)
	_, ca := localhostCA(t)
	p.DownloadCA = ca
	r := newRun(t, p)
	r.shell = []string{busybox, "sh"}
	r.env = []string{"PATH=" + bin}
	res := r.run(newToken(t)+"\n", true)
	if res.code != 0 {
		t.Fatalf("exit %d: %s", res.code, res.stderr)
	}
	if got := readFile(t, filepath.Join(r.root, "usr/local/bin/bcd")); got != string(fakeBCD("v1")) {
		t.Fatalf("binary %q", got)
	}
	if !strings.Contains(res.stderr, "BusyBox wget cannot check the server against the embedded CA") {
		t.Fatalf("no note that the CA is not used:\n%s", res.stderr)
	}
}

// R11.5: the generated script is clean under shellcheck's defaults, for
// each way it can be made (with and without a download CA).
func TestInstallScriptShellcheck(t *testing.T) {
	sc := tools.Need(t, "shellcheck", "the generated script must be clean under its defaults")
	_, _, p := setup(t)
	for name, ca := range map[string]bool{"plain": false, "download CA": true} {
		t.Run(name, func(t *testing.T) {
			q := p
			if ca {
				_, q.DownloadCA = localhostCA(t)
			}
			out, err := Generate(q)
			if err != nil {
				t.Fatal(err)
			}
			script := filepath.Join(t.TempDir(), "install-bcd.sh")
			if err := os.WriteFile(script, out, 0o644); err != nil {
				t.Fatal(err)
			}
			if msg, err := exec.Command(sc, script).CombinedOutput(); err != nil {
				t.Fatalf("shellcheck: %v\n%s", err, msg)
			}
		})
	}
}
