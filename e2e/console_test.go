package e2e

import (
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/better-compute/better-compute/internal/checks/browser"
)

// R18.2: a person approves a waiting machine on the web console of a real
// better-compute dev, and that machine's bcd, waiting on its join request,
// finishes its join.
func TestConsoleApprovesWaitingMachineR18_2(t *testing.T) {
	browser.Path(t) // skips (or fails in CI) before anything starts
	s := startDiscoverySite(t)
	const mac = "00:1b:21:0a:0b:0c" // the MAC of dev's ramdisk machine
	s.vouch(t, mac, loopback)
	ramdisk := s.ramdisk(t, "--boot-mac", mac, "--boot-ip", loopback)
	id := waitingRequest(t, ramdisk)

	ctx := browser.New(t, 60*time.Second)
	dir := browser.Artifacts(t, "console-e2e")
	base := strings.TrimSuffix(s.env["BETTER_COMPUTE_URL"], "/") + "/api/compute/console" // as dev prints it
	row := `tr[data-id="` + id + `"]`
	browser.Run(t, ctx,
		chromedp.Navigate(base+"/"),
		chromedp.WaitVisible(chromedp.CSS("#signin")),
		chromedp.SendKeys(chromedp.CSS("#key"), s.env["BETTER_COMPUTE_API_KEY"]),
		browser.Submit("#signin-submit"),
		chromedp.WaitVisible(chromedp.CSS("#join-requests")),
		chromedp.Navigate(base+"/join-requests?tenant="+s.env["TENANT"]+"&pool="+s.env["POOL"]),
		chromedp.WaitVisible(chromedp.CSS(row)),
		browser.Shot(t, dir, "waiting.png"),
		chromedp.Click(chromedp.CSS(row+` input[type="checkbox"]`)),
		chromedp.SendKeys(chromedp.CSS("#reason"), "rack B7 intake"),
		browser.Submit("#approve"),
		chromedp.WaitNotPresent(chromedp.CSS(row)),
	)
	// The machine's bcd asks again on its own and is admitted.
	if code := ramdisk.exited(t, 60*time.Second); code != 0 || !strings.Contains(ramdisk.output(), "joined as node_") {
		t.Fatalf("the approved machine's bcd: exit %d\n%s", code, ramdisk.output())
	}
	browser.Run(t, ctx,
		chromedp.Navigate(base+"/join-requests?tenant="+s.env["TENANT"]+"&pool="+s.env["POOL"]+"&state=all"),
		chromedp.WaitVisible(chromedp.CSS(row+`[data-state="consumed"]`)),
		browser.Shot(t, dir, "consumed.png"),
	)
}
