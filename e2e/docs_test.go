package e2e

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/doctest"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/node/tpmdevice/tpmtest"
)

// docFiles are the docs whose blocks are accounted for: every sh block is
// run by a walkthrough below or skipped in the doc with a reason. The
// other docs/*.md files are not marked up yet. A pattern names every file
// it matches (filepath.Glob).
var docFiles = []string{"README.md", "docs/tpm.md", "docs/joining.md", "docs/operations.md", "docs/operations/*.md"}

// TestDocsBlocksAccounted: no doc shows a command block a test does not run
// unless the doc says why.
func TestDocsBlocksAccounted(t *testing.T) {
	for _, pattern := range docFiles {
		for _, f := range docPaths(t, pattern) {
			if _, err := doctest.Parse(f, readDoc(t, f)); err != nil {
				t.Error(err)
			}
		}
	}
}

// docPaths returns the docs pattern names, relative to the repository's
// root, and fails when it names none.
func docPaths(t *testing.T, pattern string) []string {
	t.Helper()
	matches, err := filepath.Glob(filepath.Join("..", pattern))
	if err != nil || len(matches) == 0 {
		t.Fatalf("no doc matches %s (%v)", pattern, err)
	}
	for i, m := range matches {
		matches[i], _ = filepath.Rel("..", m)
	}
	return matches
}

// TestReadmeWalkthrough runs README.md's "Every flow on one laptop" as a
// new user would, from a fresh directory with the built binaries on PATH,
// and compares what each block prints with the output the README shows
// : the README is the test's script, so it cannot go stale.
func TestReadmeWalkthrough(t *testing.T) {
	runWalkthrough(t, "README.md", nil, "readme-laptop")
}

// TestOperationsWalkthrough runs docs/operations/install.md's "First
// install" (the PKI, the two certificates, the printed config, bootstrap
// and serve), then backup-restore.md's SQLite backup beside the running
// server, a verify and a restore (R16.3). The doc's /etc, /var/lib and /backups paths move under the
// test's directory, and the config's listeners to port 0 (the edit the
// doc leaves to the reader); the restore's placeholder secret is the one
// the shell already exported.
func TestOperationsWalkthrough(t *testing.T) {
	runWalkthrough(t, "docs/operations/*.md", func(work string) []doctest.Replacement {
		etc, lib := filepath.Join(work, "etc/better-compute"), filepath.Join(work, "var/lib/better-compute")
		must(t, os.MkdirAll(etc, 0o750))
		// The doc's later blocks name none of these listeners: port 0.
		edit := fmt.Sprintf(` && sed -i 's|/etc/better-compute|%s|g; s|/var/lib/better-compute|%s|g; s|":8443"|"127.0.0.1:0"|; s|":8444"|"127.0.0.1:0"|; s|"127.0.0.1:9090"|"127.0.0.1:0"|' config.toml`,
			etc, lib)
		// In order: the doc's paths first, then the edit (which names them).
		must(t, os.MkdirAll(filepath.Join(work, "backups"), 0o700))
		return []doctest.Replacement{
			{Old: "/etc/better-compute", New: etc}, {Old: "/var/lib/better-compute", New: lib},
			{Old: "> config.toml", New: "> config.toml" + edit},
			{Old: "/backups/", New: filepath.Join(work, "backups") + "/"},
			{Old: "export BETTER_COMPUTE_SECRET=…", New: ":"},
		}
	}, "operations-first-install", "operations-backup")
}

// TestJoiningWalkthrough runs docs/joining.md's laptop flows against dev
// (R4, R10.1): a token join from a fake machine, a refused second use and
// its event, and a discovery join a site agent vouched for waiting on a
// join request an operator approves.
func TestJoiningWalkthrough(t *testing.T) {
	runWalkthrough(t, "docs/joining.md", nil, "joining-laptop")
}

// TestTPMWalkthrough runs docs/tpm.md's swtpm lab (R9.1): provision an
// swtpm with a local CA in the home directory, run it, start dev trusting
// that CA and join with no token. swtpm's ports move to free ones.
func TestTPMWalkthrough(t *testing.T) {
	tpmtest.Require(t)
	runWalkthrough(t, "docs/tpm.md", func(string) []doctest.Replacement {
		cmd, ctrl := freePortPair(t)
		return []doctest.Replacement{
			{Old: "127.0.0.1:2321", New: "127.0.0.1:" + cmd},
			{Old: "port=2321", New: "port=" + cmd}, {Old: "port=2322", New: "port=" + ctrl},
		}
	}, "tpm-swtpm")
}

// freePortPair returns two consecutive ports that were free: swtpm's
// command port and its control channel.
func freePortPair(t *testing.T) (string, string) {
	t.Helper()
	for range 20 {
		// swtpm takes its ports on its command line and reports none.
		_, p, _ := net.SplitHostPort(freePort(t))
		n, _ := strconv.Atoi(p)
		if l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(n+1)); err == nil {
			_ = l.Close()
			return p, strconv.Itoa(n + 1)
		}
	}
	t.Fatal("no two consecutive free ports")
	return "", ""
}

func readDoc(t *testing.T, rel string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", rel))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// runWalkthrough runs walkthroughs of a doc, in order, in one shell in a
// temp directory; file may be a pattern (filepath.Glob), whose docs'
// walkthroughs are then taken by name from all of them. The
// doc's commands run as written, but for what a shared test machine needs:
// the binaries are the ones this test built, and dev listens on ports
// picked free instead of 8080 and 8443.
func runWalkthrough(t *testing.T, file string, rewrite func(work string) []doctest.Replacement, names ...string) {
	bc, _ := binaries(t)
	var blocks []doctest.Block
	for _, f := range docPaths(t, file) {
		bs, err := doctest.ParseWalkthroughs(f, readDoc(t, f))
		if err != nil {
			t.Fatal(err)
		}
		blocks = append(blocks, bs...)
	}
	var steps []doctest.Block
	for _, name := range names {
		s := doctest.Walkthrough(blocks, name)
		if len(s) == 0 {
			t.Fatalf("%s has no walkthrough %q", file, name)
		}
		steps = append(steps, s...)
	}
	work := t.TempDir()
	// The docs' commands name dev's addresses (--gateway-url, BETTER_COMPUTE_URL), rewritten before dev starts.
	api, gw := freePort(t), freePort(t)
	sh, err := doctest.NewShell(work, []string{"HOME=" + work, "PATH=" + filepath.Dir(bc) + ":" + os.Getenv("PATH"), "BETTER_COMPUTE_URL=", "BETTER_COMPUTE_API_KEY="})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sh.Close(15 * time.Second) })
	sh.Rewrite = []doctest.Replacement{
		{Old: "go build -o bin/ ./cmd/...", New: "mkdir -p bin && cp " + filepath.Dir(bc) + "/* bin/"},
		{Old: "better-compute dev ", New: "better-compute dev --listen " + api + " --gateway-listen " + gw + " "},
		{Old: "127.0.0.1:8080", New: api},
		{Old: "127.0.0.1:8443", New: gw},
	}
	if rewrite != nil {
		sh.Rewrite = append(rewrite(work), sh.Rewrite...)
	}
	norm := doctest.Normaliser{Replace: []doctest.Replacement{
		{Old: work, New: "$WORK"}, {Old: "/tmp/walk2", New: "$WORK"}, {Old: "/tmp/walk", New: "$WORK"},
	}}
	for _, b := range steps {
		res, err := sh.Run(b, 90*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if b.Output == nil {
			for _, r := range res {
				if !r.Background && r.Code != 0 {
					t.Fatalf("%s: %q exited %d:\n%s", b.Where(), r.Command, r.Code, r.Output())
				}
			}
			continue
		}
		checkBlock(t, norm, b, res)
	}
}

// checkBlock compares a block's output with the doc's. Background output
// grows: it is read again until it matches or 60 s passed. A block whose
// output shows no "Error:" must have every command succeed.
func checkBlock(t *testing.T, norm doctest.Normaliser, b doctest.Block, res []doctest.Result) {
	t.Helper()
	bg := false
	for _, r := range res {
		bg = bg || r.Background
		if !r.Background && r.Code != 0 && !strings.Contains(b.Output.Text, "Error:") {
			t.Fatalf("%s: %q exited %d (the doc shows no error):\n%s", b.Where(), r.Command, r.Code, r.Output())
		}
	}
	var ok bool
	var diff string
	wait := time.Duration(0)
	if bg {
		wait = 60 * time.Second
	}
	poll.WaitEvery(wait, 200*time.Millisecond, func() bool {
		ok, diff = norm.Match(b.Output.Text, doctest.Combined(res))
		return ok
	})
	if !ok {
		t.Fatalf("%s: the output differs from %s:%d\n%s", b.Where(), b.Output.File, b.Output.Line, diff)
	}
}
