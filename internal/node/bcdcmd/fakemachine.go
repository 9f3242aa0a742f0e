package bcdcmd

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"strings"
	"text/tabwriter"

	"github.com/better-compute/better-compute/internal/node/cmdline"

	"github.com/better-compute/better-compute/internal/node/claims"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/fakemachine"
	"github.com/better-compute/better-compute/internal/shared/hwid"
)

type fakeMachineFlags struct {
	out, procfsOut string
	m              fakemachine.Machine
	json           bool
}

// fakeMachineCmd is `bcd fake-machine`: a sysfs tree for trying joins on a
// laptop, a VM or a CI runner, which have no DMI serials bcd may read (or
// only placeholders) and no permanent MACs worth claiming.
func (a *app) fakeMachineCmd() *cmdline.Command {
	var f fakeMachineFlags
	cmd := &cmdline.Command{
		Use:   "fake-machine --out DIR --serial SERIAL",
		Short: "Write the sysfs tree of a made-up machine, to join with bcd join --sysfs-root",
		Long: `Write the files bcd reads for its hardware claims, for a machine that does
not exist: the DMI product UUID and serials under class/dmi/id, and one NIC
per --mac under class/net (with the device link and addr_assign_type that
make it a physical NIC with a permanent address). Then

    bcd join --config bc-dev/bcd/config.toml --sysfs-root DIR < join-token

joins it, as better-compute dev's walkthrough does (docs/joining.md).

Values are written as given, placeholders too (--serial 'To Be Filled By
O.E.M.' makes placeholder hardware). Without --product-uuid a random one is
made, without --mac one random permanent MAC. --gpu-uuid writes NVIDIA GPUs
under --procfs-out, for bcd join --procfs-root.

Writing again over DIR replaces the machine (swap a NIC: same --serial and
--product-uuid, another --mac). A DIR that is not empty and was not written
by bcd fake-machine is never touched.`,
		Example: `  bcd fake-machine --out ./fake-sys --serial SN-7701
  bcd fake-machine --out ./fake-sys --serial SN-7701 --product-uuid 4c4c4544-0042-3510-8053-b7c04f5a3132 --mac 3c:ec:ef:01:02:03
  bcd fake-machine --out ./fake-sys --serial SN-7701 --gpu-uuid GPU-8f0c1d2e-aaaa-bbbb-cccc-ddddeeeeffff --procfs-out ./fake-proc`,
		Args: noArgs,
		RunE: func(cmd *cmdline.Command, _ []string) error {
			if !cmd.Flags().Changed("product-uuid") {
				f.m.ProductUUID = randomUUID()
			}
			if !cmd.Flags().Changed("mac") {
				f.m.MACs = []string{randomMAC()}
			}
			return a.fakeMachine(&f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.out, "out", "", "the directory to write, then bcd join --sysfs-root (created; replaced only when bcd fake-machine wrote it)")
	fl.StringVar(&f.m.ProductSerial, "serial", "", "the product serial (class/dmi/id/product_serial)")
	fl.StringVar(&f.m.ProductUUID, "product-uuid", "", "the product UUID (default: a random one)")
	fl.StringVar(&f.m.BoardSerial, "board-serial", "", "the board serial (default: empty)")
	fl.StringVar(&f.m.ChassisSerial, "chassis-serial", "", "the chassis serial (default: empty)")
	fl.StringSliceVar(&f.m.MACs, "mac", nil, "the permanent MAC of a physical NIC, once per NIC (default: one random MAC)")
	fl.StringSliceVar(&f.m.GPUUUIDs, "gpu-uuid", nil, "an NVIDIA GPU UUID, once per GPU (needs --procfs-out)")
	fl.StringVar(&f.procfsOut, "procfs-out", "", "the procfs directory for --gpu-uuid, then bcd join --procfs-root")
	fl.BoolVar(&f.json, "json", false, "print the claims bcd will send as JSON")
	return cmd
}

func (a *app) fakeMachine(f *fakeMachineFlags) error {
	if err := required("--out", f.out); err != nil {
		return err
	}
	if err := required("--serial", f.m.ProductSerial); err != nil {
		return err
	}
	out, err := absDir("--out", f.out)
	if err != nil {
		return err
	}
	proc, err := absDir("--procfs-out", f.procfsOut)
	if err != nil {
		return err
	}
	if err := fakemachine.Write(out, proc, f.m); err != nil {
		return err
	}
	// Read it back as bcd join will: what is printed is what is claimed.
	c, warnings, err := claims.New(claims.Config{SysfsRoot: out, ProcfsRoot: procOrEmpty(proc, out)}).Collect()
	if err != nil {
		return err
	}
	for _, w := range warnings {
		fmt.Fprintf(a.env.Stderr, "warning: %s\n", w)
	}
	k, err := hwid.KeyOf(c)
	if err != nil {
		return err
	}
	if f.json {
		return printJSON(a.env.Stdout, c)
	}
	w := a.env.Stdout
	fmt.Fprintf(w, "wrote a fake machine to %s\n", out)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, row := range [][2]string{
		{"product uuid", c.ProductUUID}, {"product serial", c.ProductSerial}, {"board serial", c.BoardSerial},
		{"chassis serial", c.ChassisSerial}, {"macs", strings.Join(c.MACs, " ")}, {"gpu uuids", strings.Join(c.GPUUUIDs, " ")},
	} {
		if row[1] != "" {
			fmt.Fprintf(tw, "  %s:\t%s\n", row[0], row[1])
		}
	}
	fmt.Fprintf(tw, "  hardware key:\t%s\n", describeKey(k))
	tw.Flush()
	join := "bcd join --config bc-dev/bcd/config.toml --sysfs-root " + out
	if proc != "" {
		join += " --procfs-root " + proc
	}
	fmt.Fprintf(w, "join it (with better-compute dev's bcd config):\n  %s < join-token\n", join)
	return nil
}

// procOrEmpty is the procfs root to read the fake machine back with: its
// own, else a directory without a GPU driver (the fake sysfs root), so the
// host's GPUs are not shown as the fake machine's.
func procOrEmpty(proc, sys string) string {
	if proc != "" {
		return proc
	}
	return sys
}

// describeKey says what the rules of R6.1–R6.3 make of a hardware key (R6.1–R6.3).
func describeKey(k hwid.HardwareKey) string {
	switch {
	case !k.Present:
		return "none (only placeholders): a token join needs an --expect-* binding (placeholder-hardware)"
	case k.PlaceholderHardware():
		return k.Hex()[:16] + "… untrusted or without a product UUID or serial: a token join needs an --expect-* binding (placeholder-hardware)"
	case k.Stable:
		return k.Hex()[:16] + "… trusted, from the product UUID and serials: a NIC or GPU swap keeps it"
	default:
		return k.Hex()[:16] + "… trusted, from every identifier: a NIC or GPU swap makes a new machine"
	}
}

// randomUUID returns a random (version 4) UUID.
func randomUUID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// randomMAC returns a random unicast, globally administered MAC: one bcd
// claims as a permanent NIC address.
func randomMAC() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	b[0] &^= 0x03
	b[5] |= 0x01 // first octet even, last odd: never zero, never one repeated octet
	return net.HardwareAddr(b[:]).String()
}

// required refuses an empty flag.
func required(flag, v string) error {
	if strings.TrimSpace(v) == "" {
		return errs.Invalid(flag, "required")
	}
	return nil
}
