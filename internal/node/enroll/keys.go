package enroll

import (
	"context"
	"crypto/tls"
	"log/slog"
	"slices"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/node/config"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

const (
	// keysTimeout bounds one JoinService.Keys call, TLS handshake included.
	keysTimeout = 30 * time.Second
	// maxKeysResponseSize bounds its answer: MaxKeyStatements of at most
	// 4 KiB each, and framing.
	maxKeysResponseSize = pki.MaxKeyStatements*(4<<10) + 4<<10
)

// FetchKeyStatements calls JoinService.Keys on the gateway at gatewayURL
// over TLS that verifies nothing (SNI is still serverName) and returns the
// key statements it answered (R16.2).
//
// SECURITY: this is the one dial of bcd without pinned verification, for a
// bcd that was offline through a rotation of the serving CA and so cannot
// verify its gateway any more. Nothing is sent but an empty request, and
// the answer is untrusted: its statements count only when signed by a key
// bcd already pins (config.Pins.Learn, pki.ApplyStatements), which an
// impostor cannot forge.
func FetchKeyStatements(ctx context.Context, hc HTTPClientFunc, gatewayURL, serverName string) ([]string, error) {
	res, err := fetchKeys(ctx, hc, gatewayURL, serverName)
	if err != nil {
		return nil, errs.Wrap(err, errs.Unavailable, "cannot ask the gateway for the rotated keys: %v", err)
	}
	st := res.GetKeyStatements()
	if len(st) > pki.MaxKeyStatements {
		st = st[:pki.MaxKeyStatements]
	}
	return st, nil
}

// FetchServerTime calls JoinService.Keys as FetchKeyStatements does and
// returns the control plane's time it answered (Unix milliseconds; 0 from
// a server before the field). R19.3: it is a hint only, used to correct
// bcd's clock before it retries a join or renewal refused for its time;
// the server enforces its own windows whatever bcd claims.
func FetchServerTime(ctx context.Context, hc HTTPClientFunc, gatewayURL, serverName string) (int64, error) {
	res, err := fetchKeys(ctx, hc, gatewayURL, serverName)
	if err != nil {
		return 0, errs.Wrap(err, errs.Unavailable, "cannot ask the gateway for the control plane's time: %v", err)
	}
	return res.GetServerTimeUnixMs(), nil
}

// fetchKeys is the one unverified dial (see FetchKeyStatements).
func fetchKeys(ctx context.Context, hc HTTPClientFunc, gatewayURL, serverName string) (*agentv1.KeysResponse, error) {
	if hc == nil {
		hc = DefaultHTTPClient
	}
	tc := &tls.Config{
		ServerName: serverName,
		MinVersion: tls.VersionTLS12,
		// The answer is untrusted, see above: the statements carry their
		// own signatures under pinned keys.
		InsecureSkipVerify: true,
	}
	client := agentv1connect.NewJoinServiceClient(hc(tc), gatewayURL,
		connect.WithGRPC(), connect.WithReadMaxBytes(maxKeysResponseSize))
	ctx, cancel := context.WithTimeout(ctx, keysTimeout)
	defer cancel()
	res, err := client.Keys(ctx, connect.NewRequest(&agentv1.KeysRequest{}))
	if err != nil {
		return nil, err
	}
	return res.Msg, nil
}

// RecoverPins is bcd's way back after a rotation it slept through (R16.2):
// a dial to the gateway failed because its chain matches no pinned serving
// CA (PinFailure), so bcd fetches the key statements (FetchKeyStatements),
// applies those a pinned key signed, and persists them. It returns whether
// the serving-CA set changed: only then may the caller dial again, once.
// log receives what happened; nil discards.
func RecoverPins(ctx context.Context, pins *config.Pins, hc HTTPClientFunc, gatewayURL, serverName string, log *slog.Logger) bool {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if pins == nil {
		return false
	}
	before := pins.Set(pki.KindServingCA)
	log.Warn("the gateway's certificate matches no pinned serving CA: asking it for rotated keys (only those a pinned key vouches for count)", telemetry.LogGateway, gatewayURL)
	st, err := FetchKeyStatements(ctx, hc, gatewayURL, serverName)
	if err != nil {
		log.Warn("cannot fetch rotated keys", telemetry.LogGateway, gatewayURL, telemetry.LogErr, err)
		return false
	}
	// A write error is logged by Learn; the sets learned are used anyway.
	u, _ := pins.Learn("keys", st)
	if _, ok := u.Kind(pki.KindServingCA); !ok || slices.Equal(before, pins.Set(pki.KindServingCA)) {
		log.Warn("no rotated serving CA vouched for by a pinned key: the gateway stays refused", telemetry.LogGateway, gatewayURL, telemetry.LogStatements, len(st))
		return false
	}
	log.Info("learned the rotated serving CA: dialing the gateway again", telemetry.LogGateway, gatewayURL)
	return true
}

// syncPins copies the live sets into cfg, so a dial made with cfg uses
// what the session or the renewer learned.
func syncPins(cfg *bcdconfig.Config, pins *config.Pins) {
	if pins == nil {
		return
	}
	for _, k := range bcdconfig.PinKinds() {
		if s := pins.Set(k); len(s) > 0 {
			cfg.SetPinSet(k, s)
		}
	}
	cfg.RetiredPins = pins.Retired()
}
