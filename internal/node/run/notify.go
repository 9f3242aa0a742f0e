package run

import (
	"net"
	"time"

	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// notify sends state to systemd's NOTIFY_SOCKET (sd_notify), if set. It
// is best effort: a failure is logged, never fatal.
func (d *Daemon) notify(state string) {
	if d.cfg.NotifySocket == "" {
		return
	}
	if err := SDNotify(d.cfg.NotifySocket, state); err != nil {
		d.log.Warn("sd_notify", telemetry.LogState, state, telemetry.LogErr, err)
	}
}

// SDNotify writes one datagram to the unixgram socket (a leading @ names
// an abstract socket).
func SDNotify(socket, state string) error {
	name := socket
	if name[0] == '@' {
		name = "\x00" + name[1:]
	}
	c, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: name, Net: "unixgram"})
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetWriteDeadline(time.Now().Add(time.Second))
	_, err = c.Write([]byte(state))
	return err
}
