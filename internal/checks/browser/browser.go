// Package browser starts headless Chromium for tests that drive the web
// console (chromedp), with the flags this machine kind needs (no network
// of Chromium's own), and writes screenshots as test artifacts. With
// CI=true a missing Chromium fails the test; elsewhere it skips loudly.
package browser

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/tools"

	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
)

// Path finds the browser: with CI=true a missing one fails the test.
func Path(t testing.TB) string {
	t.Helper()
	for _, p := range []string{"/usr/bin/chromium", "chromium", "chromium-browser"} {
		if path, err := exec.LookPath(p); err == nil {
			return path
		}
	}
	why := "a browser test of the web console: apt-get install -y chromium"
	tools.Missing(t, "chromium is not installed", why)
	t.Skipf("SKIPPING: chromium is not installed (%s)", why)
	return ""
}

// Artifacts is the directory screenshots go to: $BC_TEST_ARTIFACTS/name,
// or a temporary directory when the variable is unset.
func Artifacts(t testing.TB, name string) string {
	t.Helper()
	dir := os.Getenv("BC_TEST_ARTIFACTS")
	if dir == "" {
		return t.TempDir()
	}
	dir = filepath.Join(dir, name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// New starts a headless Chromium for the test, ended with it, and returns
// its context bounded by timeout. The servers tests start use throwaway
// test CAs, so certificate errors are ignored.
func New(t testing.TB, timeout time.Duration) context.Context {
	t.Helper()
	opts := []chromedp.ExecAllocatorOption{chromedp.ExecPath(Path(t)), chromedp.Headless, chromedp.NoSandbox, chromedp.DisableGPU,
		chromedp.NoFirstRun, chromedp.Flag("disable-quic", true), chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true), chromedp.Flag("disable-sync", true), chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("ignore-certificate-errors", true), chromedp.WindowSize(1280, 720)}
	actx, cancel := chromedp.NewExecAllocator(context.Background(), opts...)
	t.Cleanup(cancel)
	bctx, cancel2 := chromedp.NewContext(actx)
	t.Cleanup(cancel2)
	if err := chromedp.Do(bctx); err != nil { // starts the browser
		t.Fatal(err)
	}
	ctx, cancel3 := context.WithTimeout(bctx, timeout)
	t.Cleanup(cancel3)
	return ctx
}

// Shot writes a full-page screenshot to dir/name.
func Shot(t testing.TB, dir, name string) chromedp.Action[chromedp.Void] {
	return chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
		png, err := chromedp.FullScreenshot(100)(ctx, tg)
		if err != nil {
			return err
		}
		t.Logf("screenshot %s", filepath.Join(dir, name))
		return os.WriteFile(filepath.Join(dir, name), png, 0o644)
	})
}

// Run runs the browser steps; on failure it fails the test with the page.
func Run(t testing.TB, ctx context.Context, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	if err := chromedp.Do(ctx, steps...); err != nil {
		dump, _ := chromedp.Run(context.WithoutCancel(ctx), chromedp.OuterHTML(chromedp.CSS("body")))
		t.Fatalf("browser: %v\npage: %s", err, dump)
	}
}

// Text reads the text of the element sel into out.
func Text(sel string, out *string) chromedp.Action[chromedp.Void] {
	return chromedp.Func(func(ctx context.Context, tg *chromedp.Target) (err error) {
		*out, err = chromedp.Text(chromedp.CSS(sel))(ctx, tg)
		return err
	})
}

// Submit clicks sel, a button that submits a form, and waits for the page
// the submission leads to (after its redirect) to load. A plain Click
// returns at once, and the next steps may then find their element in the
// page being replaced and act on it after it is gone (chromedp's "No node
// with given id found").
func Submit(sel string) chromedp.Action[chromedp.Void] {
	return chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
		_, err := chromedp.WaitEvent(page.LoadEventFired, nil, chromedp.Click(chromedp.CSS(sel)))(ctx, tg)
		return err
	})
}
